"""The storage configuration, parsed once into typed values: one backend or a tier chain.

What a user writes (worker YAML and flags, the connector's ``kv_connector_extra_config``,
``kvtier demo``) is a mapping: ``{"backend": "file", "root": ...}`` or ``{"tiers": [...],
"write": "through"}``. ``parse_storage`` turns it into a ``BackendConfig`` or a ``ChainConfig``
once, raising a ConfigError that names the field (``storage.tiers[1].root``); everything after
that — validation at the edge, building the backends in the worker, describing them in status
and logs — reads the typed values. Each backend kind is one entry of a registry (its option
parser and its builder), so a new kind is one entry, not an edit in every place that reads the
config. A kind is a module path: the module defines ``parse_options(mapping)`` (the typed
options; ConfigError naming ``storage.<field>``) and ``open_backend(spec, options, mac_key)``.
The built-in kinds are the packages ``kvtier.storage.file``, ``.memory``, ``.mooncake`` and
``.s3``; a backend outside kvtier is named in the configuration itself, ``{"backend": "mine",
"module": "my_package.kvtier_backend", ...}`` (imported when the config is parsed: the config
is the engine user's, as trusted as the code it runs), or registered by code with
``register_backend``. Only the kinds a config names are imported. Nothing here imports torch:
``kvtier --help`` and ``kvtier store`` parse configs without loading a backend.

Once per process: a mapping is parsed the first time a process asks, and the same typed value
is returned for the same mapping under the same environment after that (parsers read a few
variables: ``XDG_CACHE_HOME`` for the default root, ``AWS_ENDPOINT_URL``). A vLLM start asks
from its settings check, its scheduler and worker connectors and its launcher, and the kvtier
worker from its own config: one parse in the engine's process and one in each worker's.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from kvtier.common.config_sources import positive, refuse_unknown
from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.layout.spec import KVCacheSpec
    from kvtier.storage.base import StorageBackend
    from kvtier.storage.mooncake.config import MooncakeConfig

MAC_KEY_FILE = "mac_key_file"
CHAIN_OPTIONS = ("tiers", "write", "pending_bytes", "flush_timeout_s", MAC_KEY_FILE)
WRITE_MODES = ("through", "back")
MAX_TIERS = 8  # a lookup names each block's tier in one byte; more tiers than this buy nothing


@dataclass(frozen=True)
class MemoryConfig:
    """The memory backend: unbounded (a dict of objects) or, with ``capacity_bytes``, a
    preallocated slab evicting least recently used objects (the memory tier)."""

    capacity_bytes: int | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MemoryConfig:
        options = {k: v for k, v in data.items() if k != "backend"}
        refuse_unknown(options, ("capacity_bytes",), "storage.", "option for the memory backend")
        capacity = data.get("capacity_bytes")
        if capacity is not None:
            positive("storage.capacity_bytes", capacity, integer=True)
        return cls(capacity)


@dataclass(frozen=True)
class FaultConfig:
    latency_s: float = 0.0  # added to every call
    # Added to every read and write of objects, not to lookups: a slow transfer path (a
    # congested link, a disk busy with others) in front of a quick index.
    transfer_latency_s: float = 0.0
    # A read of objects stalls ``stall_s`` more with probability ``stall_rate`` (a disk or link
    # that hiccups now and then: load or recompute must not switch such a store off).
    stall_rate: float = 0.0
    stall_s: float = 0.0
    error_rate: float = 0.0  # per key: a put is not stored / a get reports a miss
    corrupt_rate: float = 0.0  # per stored object: one random bit flipped after the put
    unavailable_after_s: float | None = None  # outage window, seconds after start
    unavailable_for_s: float = 0.0
    # An outage for as long as this file exists (only its existence is looked at): an operator
    # or a test starts and ends it exactly, whatever the clock and the machine's load.
    unavailable_while: str | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "latency_s",
            "transfer_latency_s",
            "stall_rate",
            "stall_s",
            "error_rate",
            "corrupt_rate",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ConfigError(f"storage.faults.{name}", f"must be a number >= 0, got {value!r}")
        for name in ("stall_rate", "error_rate", "corrupt_rate"):
            if getattr(self, name) > 1:
                raise ConfigError(f"storage.faults.{name}", "must be in [0, 1]")
        if self.unavailable_for_s < 0:
            raise ConfigError("storage.faults.unavailable_for_s", "must be >= 0")
        if self.unavailable_while is not None and not isinstance(self.unavailable_while, str):
            raise ConfigError("storage.faults.unavailable_while", "must be a file path")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FaultConfig:
        if not isinstance(data, Mapping):
            raise ConfigError("storage.faults", "must be a mapping of fault options")
        refuse_unknown(data, (f.name for f in fields(cls)), "storage.faults.", "fault option")
        return cls(**dict(data))


@dataclass(frozen=True)
class BackendKind:
    """One kind of backend: ``parse`` turns its options (the mapping, ``backend`` included) into
    typed options; ``build(spec, options, mac_key)`` opens it."""

    name: str
    parse: Callable[[Mapping[str, Any]], Any]
    build: Callable[[KVCacheSpec, Any, bytes | None], StorageBackend]


# The built-in kinds by module, imported when a config first names them.
BUILT_IN = {
    "file": "kvtier.storage.file",
    "mooncake": "kvtier.storage.mooncake",
    "memory": "kvtier.storage.memory",
    "s3": "kvtier.storage.s3",
}
_MODULES: dict[str, str] = dict(BUILT_IN)
_KINDS: dict[str, BackendKind] = {}
_MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def register_backend(
    name: str,
    parse: Callable[[Mapping[str, Any]], Any],
    build: Callable[[KVCacheSpec, Any, bytes | None], StorageBackend],
) -> None:
    """Make ``{"backend": name, ...}`` a valid storage (or tier) config everywhere."""
    if name in _KINDS or name in _MODULES or name == "tiers":
        raise ValueError(f"a storage backend named {name!r} is already registered")
    _KINDS[name] = BackendKind(name, parse, build)


def backend_names() -> tuple[str, ...]:
    return tuple(dict.fromkeys([*_MODULES, *_KINDS]))


def _kind(name: str, module: str | None = None) -> BackendKind:
    """The kind ``name``, its module imported on first use (``module``: named by the config)."""
    if module is not None:
        if not isinstance(module, str) or not _MODULE_PATH.fullmatch(module):
            raise ConfigError("storage.module", f"must be a module path (a.b.c), got {module!r}")
        known = _MODULES.get(name)
        if known is not None and known != module:
            raise ConfigError("storage.module", f"{name!r} is {known}, not {module}")
        if name in _KINDS and known is None:
            raise ConfigError("storage.module", f"{name!r} is registered by code already")
        _MODULES[name] = module
    if name in _KINDS:
        return _KINDS[name]
    if name not in _MODULES:
        raise ConfigError(
            "storage.backend",
            f"got {name!r}; allowed: {', '.join(backend_names())} (or name the module that "
            "implements it: storage.module)",
        )
    path = _MODULES[name]
    try:
        loaded = importlib.import_module(path)
    except ImportError as e:
        if module is not None:
            _MODULES.pop(name, None)
        raise ConfigError(
            "storage.module", f"cannot import {path} for backend {name!r}: {e}"
        ) from None
    parse, build = getattr(loaded, "parse_options", None), getattr(loaded, "open_backend", None)
    if not callable(parse) or not callable(build):
        if module is not None:
            _MODULES.pop(name, None)
        raise ConfigError(
            "storage.module", f"{path} must define parse_options(mapping) and open_backend(...)"
        )
    _KINDS[name] = BackendKind(name, parse, build)
    return _KINDS[name]


@dataclass(frozen=True)
class BackendConfig:
    """One backend: its kind, its typed options, and the wrappers every kind takes."""

    backend: str
    options: Any  # the kind's typed options (FileStoreConfig, MooncakeConfig, MemoryConfig, ...)
    faults: FaultConfig | None = None
    mac_key_file: str | None = None
    module: str | None = None  # where an out-of-tree kind lives (``storage.module``)

    @property
    def backends(self) -> tuple[BackendConfig, ...]:
        return (self,)

    def open(self, spec: KVCacheSpec, mac_key: bytes | None) -> StorageBackend:
        """The backend of this kind, unwrapped (``make_backend`` adds the faults)."""
        return _kind(self.backend, self.module).build(spec, self.options, mac_key)


@dataclass(frozen=True)
class ChainConfig:
    """Tiers fastest first; saves reach the lower ones ``write``-through or -back."""

    tiers: tuple[BackendConfig, ...]
    write: str = "through"
    pending_bytes: int = 256 << 20
    flush_timeout_s: float = 10.0
    mac_key_file: str | None = None

    @property
    def backends(self) -> tuple[BackendConfig, ...]:
        return self.tiers


StorageConfig = BackendConfig | ChainConfig


# Typed values already parsed in this process, by (mapping, environment): a few per process.
_PARSED: dict[tuple[str, frozenset[tuple[str, str]]], StorageConfig] = {}
_PARSED_LOCK = threading.Lock()
MAX_REMEMBERED_PARSES = 32


def parse_storage(config: Mapping[str, Any] | StorageConfig | None) -> StorageConfig:
    """The typed form of a storage mapping (already typed: returned as is; None: the default
    file store). ConfigError names the field; nothing is opened or created. Parsed once per
    process (the module docstring)."""
    if isinstance(config, (BackendConfig, ChainConfig)):
        return config
    if config is None:
        config = {"backend": "file"}
    if not isinstance(config, Mapping):
        raise ConfigError("storage", "must be a mapping with a 'backend' key (or 'tiers')")
    try:
        key = (json.dumps(config, sort_keys=True), frozenset(os.environ.items()))
    except (TypeError, ValueError):  # not plain data (a value of a type JSON lacks): parse it
        return _parse(config)
    with _PARSED_LOCK:
        known = _PARSED.get(key)
    if known is not None:
        return known
    parsed = _parse(config)
    with _PARSED_LOCK:
        if len(_PARSED) >= MAX_REMEMBERED_PARSES:
            _PARSED.pop(next(iter(_PARSED)))
        _PARSED[key] = parsed
    return parsed


def _parse(config: Mapping[str, Any]) -> StorageConfig:
    if "tiers" in config:
        return _parse_chain(config)
    return _parse_backend(config)


def _parse_backend(config: Mapping[str, Any]) -> BackendConfig:
    options = dict(config)
    kind = options.get("backend", "file")
    faults = options.pop("faults", None)
    mac_key_file = options.pop(MAC_KEY_FILE, None)
    module = options.pop("module", None)
    if mac_key_file is not None and not isinstance(mac_key_file, str):
        raise ConfigError(f"storage.{MAC_KEY_FILE}", f"must be a path, got {mac_key_file!r}")
    if not isinstance(kind, str) or not kind:
        raise ConfigError("storage.backend", f"must name a backend, got {kind!r}")
    typed = _kind(kind, module).parse(options)
    fault_config = FaultConfig.from_dict(faults) if faults else None
    return BackendConfig(kind, typed, fault_config, mac_key_file, module)


def _parse_chain(config: Mapping[str, Any]) -> ChainConfig:
    refuse_unknown(config, CHAIN_OPTIONS, "storage.", "option of a tier chain")
    tiers = config["tiers"]
    if not isinstance(tiers, list) or not tiers:
        raise ConfigError("storage.tiers", "must be a list of backend mappings, fastest first")
    if len(tiers) > MAX_TIERS:
        raise ConfigError("storage.tiers", f"has {len(tiers)} tiers; at most {MAX_TIERS}")
    parsed = []
    for i, tier in enumerate(tiers):
        if not isinstance(tier, Mapping):
            raise ConfigError(f"storage.tiers[{i}]", "must be a mapping with a 'backend' key")
        for name in ("tiers", MAC_KEY_FILE):
            if name in tier:
                raise ConfigError(f"storage.tiers[{i}].{name}", "belongs to the chain, not a tier")
        parsed.append(in_tier(i, _parse_backend, tier))
    write = config.get("write", "through")
    if write not in WRITE_MODES:
        raise ConfigError("storage.write", f"got {write!r}; allowed: {', '.join(WRITE_MODES)}")
    if write == "back" and parsed[0].backend != "memory":
        raise ConfigError("storage.write", "'back' needs a memory tier first (tiers[0])")
    pending = config.get("pending_bytes", ChainConfig.pending_bytes)
    flush = config.get("flush_timeout_s", ChainConfig.flush_timeout_s)
    positive("storage.pending_bytes", pending)
    positive("storage.flush_timeout_s", flush)
    mac_key_file = config.get(MAC_KEY_FILE)
    if mac_key_file is not None and not isinstance(mac_key_file, str):
        raise ConfigError(f"storage.{MAC_KEY_FILE}", f"must be a path, got {mac_key_file!r}")
    return ChainConfig(tuple(parsed), write, int(pending), float(flush), mac_key_file)


def in_tier(i: int, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with a ConfigError's field placed inside ``storage.tiers[i]`` (parsing a
    tier, or opening one: a memory tier too small for one object is found only then)."""
    try:
        return fn(*args)
    except ConfigError as e:
        field = e.field.replace("storage.", f"storage.tiers[{i}].", 1)
        raise ConfigError(field, e.detail) from None


def describe(config: StorageConfig) -> str:
    """``file``, or a chain's backends fastest first: ``memory+file``."""
    return "+".join(b.backend for b in config.backends)


def mooncake_config(config: StorageConfig) -> MooncakeConfig | None:
    """The Mooncake backend's options in ``config`` (one of its tiers), or None."""
    for backend in config.backends:
        if backend.backend == "mooncake":
            return backend.options
    return None
