"""Storage tier: backends behind one contract, and the factory that builds them from config."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtier.common.config_sources import refuse_unknown
from kvtier.errors import ConfigError
from kvtier.storage.file_config import FileStoreConfig
from kvtier.storage.mooncake_setup import MooncakeConfig
from kvtier.transport import auth

if TYPE_CHECKING:
    from kvtier.layout.spec import KVCacheSpec
    from kvtier.storage.base import StorageBackend, StorageStats, StorageUsage

BACKENDS = ("file", "mooncake", "memory")

__all__ = [
    "BACKENDS",
    "StorageBackend",
    "StorageStats",
    "StorageUsage",
    "describe_backend",
    "make_backend",
    "mooncake_options",
    "tier_configs",
    "validate_storage_config",
    "with_memory_tier",
]
MEMORY_OPTIONS = ("capacity_bytes",)
# The backends (and torch, which they use) load on first use: `kvtier store` needs neither.
_FROM_BASE = ("StorageBackend", "StorageStats", "StorageUsage")


def __getattr__(name: str) -> Any:
    if name in _FROM_BASE:
        from kvtier.storage import base

        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Storage options every backend takes (see kvtier.storage.format, "Authenticated objects").
MAC_KEY_FILE = "mac_key_file"
MAC_KEY_ENV = "KVTIER_STORAGE_MAC_KEY"


# A tier chain (kvtier.storage.tiers): ``tiers`` is a list of backend mappings, fastest first.
CHAIN_OPTIONS = ("tiers", "write", "pending_bytes", "flush_timeout_s", MAC_KEY_FILE)
WRITE_MODES = ("through", "back")
MAX_TIERS = 8  # a lookup names each block's tier in one byte; more tiers than this buy nothing


def tier_configs(config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The backend mappings of ``config``: its tiers, or ``[config]`` for one backend."""
    tiers = config.get("tiers")
    return list(tiers) if isinstance(tiers, list) else [config]


def mooncake_options(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The mapping of the Mooncake backend in ``config`` (one of its tiers), or None."""
    for tier in tier_configs(config):
        if isinstance(tier, Mapping) and tier.get("backend") == "mooncake":
            return tier
    return None


def describe_backend(config: Mapping[str, Any]) -> str:
    """``file``, or a chain's backends fastest first: ``memory+file``."""
    return "+".join(
        str(t.get("backend", "file")) if isinstance(t, Mapping) else "?"
        for t in tier_configs(config)
    )


def with_memory_tier(config: Mapping[str, Any], capacity_bytes: int) -> dict[str, Any]:
    """``config`` with a memory tier of ``capacity_bytes`` in front of its backend (or of its
    chain's first tier), written through."""
    chain = dict(config) if "tiers" in config else {"tiers": [dict(config)]}
    if MAC_KEY_FILE in chain["tiers"][0]:
        chain[MAC_KEY_FILE] = chain["tiers"][0].pop(MAC_KEY_FILE)
    first = chain["tiers"][0]
    if isinstance(first, Mapping) and first.get("backend") == "memory":
        raise ConfigError("memory_tier", "the storage already starts with a memory tier")
    chain["tiers"] = [{"backend": "memory", "capacity_bytes": capacity_bytes}, *chain["tiers"]]
    return chain


def _chain_options(config: Mapping[str, Any]) -> tuple[list[Mapping[str, Any]], dict[str, Any]]:
    """The tier mappings and the chain's own options (ConfigError naming the field)."""
    refuse_unknown(config, CHAIN_OPTIONS, "storage.", "option of a tier chain")
    tiers = config["tiers"]
    if not isinstance(tiers, list) or not tiers:
        raise ConfigError("storage.tiers", "must be a list of backend mappings, fastest first")
    if len(tiers) > MAX_TIERS:
        raise ConfigError("storage.tiers", f"has {len(tiers)} tiers; at most {MAX_TIERS}")
    for i, tier in enumerate(tiers):
        if not isinstance(tier, Mapping):
            raise ConfigError(f"storage.tiers[{i}]", "must be a mapping with a 'backend' key")
        for name in ("tiers", MAC_KEY_FILE):
            if name in tier:
                raise ConfigError(f"storage.tiers[{i}].{name}", "belongs to the chain, not a tier")
    write = config.get("write", "through")
    if write not in WRITE_MODES:
        raise ConfigError("storage.write", f"got {write!r}; allowed: {', '.join(WRITE_MODES)}")
    if write == "back" and tiers[0].get("backend") != "memory":
        raise ConfigError("storage.write", "'back' needs a memory tier first (tiers[0])")
    chain: dict[str, Any] = {"write": write}
    for name, default in (("pending_bytes", 256 << 20), ("flush_timeout_s", 10.0)):
        value = config.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"storage.{name}", f"must be a positive number, got {value!r}")
        chain[name] = value
    chain["pending_bytes"] = int(chain["pending_bytes"])
    return tiers, chain


def _in_tier(i: int, check, *args):
    """``check(*args)`` with a ConfigError's field placed inside ``storage.tiers[i]``."""
    try:
        return check(*args)
    except ConfigError as e:
        field = e.field.replace("storage.", f"storage.tiers[{i}].", 1)
        raise ConfigError(field, e.detail) from None


def validate_storage_config(config: Mapping[str, Any]) -> None:
    """Check a storage mapping without connecting to or creating anything (ConfigError)."""
    if "tiers" in config:
        tiers, _ = _chain_options(config)
        for i, tier in enumerate(tiers):
            _in_tier(i, validate_storage_config, tier)
        if config.get("mac_key_file") is not None and not isinstance(config["mac_key_file"], str):
            raise ConfigError(f"storage.{MAC_KEY_FILE}", "must be a path")
        return
    options = dict(config)
    kind = options.pop("backend", "file")
    faults = options.pop("faults", None)
    mac_key_file = options.pop(MAC_KEY_FILE, None)
    if mac_key_file is not None and not isinstance(mac_key_file, str):
        raise ConfigError(f"storage.{MAC_KEY_FILE}", f"must be a path, got {mac_key_file!r}")
    if kind == "file":
        FileStoreConfig.from_dict(options)
    elif kind == "mooncake":
        MooncakeConfig.from_dict(options)
    elif kind == "memory":
        _memory_options(options)
    else:
        raise ConfigError("storage.backend", f"got {kind!r}; allowed: {', '.join(BACKENDS)}")
    if faults:
        from kvtier.storage.faults import FaultConfig

        if not isinstance(faults, Mapping):
            raise ConfigError("storage.faults", "must be a mapping of fault options")
        FaultConfig.from_dict(faults)


def _memory_options(options: Mapping[str, Any]) -> int | None:
    refuse_unknown(options, MEMORY_OPTIONS, "storage.", "option for the memory backend")
    capacity = options.get("capacity_bytes")
    if capacity is not None and (
        isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0
    ):
        raise ConfigError("storage.capacity_bytes", f"must be a positive integer, got {capacity!r}")
    return capacity


def make_backend(spec: KVCacheSpec, config: Mapping[str, Any] | None = None) -> StorageBackend:
    """Build a backend from ``{"backend": "file" | "mooncake" | "memory", ...options}``, or a
    tier chain from ``{"tiers": [backend mappings, fastest first], "write": "through" | "back"}``.

    A ``faults`` mapping in the config wraps the backend in a FaultInjectingStore;
    ``mac_key_file`` (or ``$KVTIER_STORAGE_MAC_KEY``, hex) makes every object authenticated.
    """
    config = config or {"backend": "file"}
    if "tiers" not in config:
        options = dict(config)
        return _make_one(spec, options, read_mac_key(options.pop(MAC_KEY_FILE, None)))
    from kvtier.storage.tiers import TieredStore

    tiers, chain = _chain_options(config)
    mac_key = read_mac_key(config.get(MAC_KEY_FILE))
    built: list[StorageBackend] = []
    try:
        for i, tier in enumerate(tiers):
            built.append(_in_tier(i, _make_one, spec, dict(tier), mac_key))
        return TieredStore(built, mac_key=mac_key, **chain)
    except BaseException:
        for backend in built:
            backend.close()
        raise


def _make_one(spec: KVCacheSpec, options: dict[str, Any], mac_key: bytes | None) -> StorageBackend:
    kind = options.pop("backend", "file")
    faults = options.pop("faults", None)
    if kind == "file":
        from kvtier.storage.file import FileStore

        backend: StorageBackend = FileStore(spec, options, mac_key=mac_key)
    elif kind == "mooncake":
        from kvtier.storage.mooncake import MooncakeStore

        backend = MooncakeStore(spec, options, mac_key=mac_key)
    elif kind == "memory":
        capacity = _memory_options(options)
        if capacity is None:
            from kvtier.storage.memory import MemoryStore

            backend = MemoryStore(spec, mac_key=mac_key)
        else:  # bounded: a preallocated slab (the memory tier)
            from kvtier.storage.arena import ArenaStore

            backend = ArenaStore(spec, capacity, mac_key=mac_key)
    else:
        raise ConfigError("storage.backend", f"got {kind!r}; allowed: {', '.join(BACKENDS)}")
    if faults:
        from kvtier.storage.faults import FaultInjectingStore

        backend = FaultInjectingStore(backend, faults)
    return backend


def read_mac_key(path: str | None) -> bytes | None:
    """The MAC key: from ``path`` (a 0600 file of this user, hex), else from the environment."""

    field = f"storage.{MAC_KEY_FILE}"
    if path is not None:
        return auth.read_key(path, field)
    text = os.environ.get(MAC_KEY_ENV)
    if not text:
        return None
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ConfigError(MAC_KEY_ENV, "must hold the MAC key in hex") from None
    if len(key) < auth.MIN_KEY_BYTES:
        raise ConfigError(MAC_KEY_ENV, f"holds {len(key)} bytes; at least {auth.MIN_KEY_BYTES}")
    return key
