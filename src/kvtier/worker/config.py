"""WorkerConfig: everything a worker needs, validated once; built from YAML, env and flags.

Precedence, field by field: command-line flags (or call arguments) > ``KVTIER_*`` environment
variables > the YAML file > defaults (``kvtier.common.config_sources``). Errors are ``ConfigError``
naming the field and where its value came from. This module and the CLI are the only places that
read the process environment: library code takes the validated config.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import stat
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import yaml

from kvtier.common.config_sources import Source, merge, positive, refuse_unknown
from kvtier.common.cpus import parse_cpu_list
from kvtier.common.user_dirs import check_parent_directory
from kvtier.errors import ConfigError
from kvtier.layout.spec import KVCacheSpec
from kvtier.storage import StorageConfig, parse_storage
from kvtier.transport.base import LOCAL_SCHEME

log = logging.getLogger(__name__)

ENV_PREFIX = "KVTIER_"
MOONCAKE_ENV_PREFIX = "KVTIER_MOONCAKE_"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
ENGINE_TIMEOUT_S = 30.0  # the old system waited 600 s before an orphaned manager gave up
START_TIMEOUT_S = 120.0  # an engine's start (vLLM loads weights before its first hello)


class DeviceCacheMode(str, Enum):
    """Who owns a rank's device cache."""

    ATTACH = "attach"  # the engine created it; the worker maps it by name
    CREATE = "create"  # the worker creates it (and removes it when it stops)


def default_socket_dir() -> Path:
    """A private (0700, ours, not a link) directory for the workers' ipc:// sockets.

    ``$XDG_RUNTIME_DIR/kvtier-$UID``, or ``$TMPDIR/kvtier-$UID`` when XDG_RUNTIME_DIR is unset.
    A directory there that is a symbolic link, belongs to another user or is open to others is
    refused: another local user could otherwise run a fake worker on our socket path.
    """
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    check_parent_directory(
        base, "XDG_RUNTIME_DIR" if os.environ.get("XDG_RUNTIME_DIR") else "TMPDIR"
    )
    path = Path(base) / f"kvtier-{os.getuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ConfigError(
            "endpoint",
            f"socket directory {path} is not a private directory of this user (it must be a "
            "directory, owned by us, mode 0700, not a link): remove it or set XDG_RUNTIME_DIR",
        )
    return path


MAX_SOCKET_PATH = 107  # bytes in a Unix socket's address (sun_path, 108 with its NUL)


def endpoint_for(instance_id: str, rank: int, socket_dir: Path | None = None) -> str:
    path = f"{socket_dir or default_socket_dir()}/{instance_id}-rank{rank}.sock"
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise ConfigError(
            "endpoint",
            f"the socket path {path} is {len(path.encode())} bytes, over the "
            f"{MAX_SOCKET_PATH} a Unix socket allows: set XDG_RUNTIME_DIR (or TMPDIR) to a "
            "shorter directory, or use a shorter instance id",
        )
    return f"ipc://{path}"


def check_instance_id(instance_id: object) -> None:
    """ConfigError unless ``instance_id`` names workers, caches and sockets safely."""
    if not isinstance(instance_id, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", instance_id):
        raise ConfigError(
            "instance_id", f"must be 1-64 letters, digits, '._-', got {instance_id!r}"
        )


@dataclass(frozen=True)
class WorkerConfig:
    spec: KVCacheSpec
    instance_id: str
    rank: int = 0
    world_size: int = 1
    device_cache: str = ""  # name; default kvtier-{instance}-rank{rank}-dev0
    device_cache_mode: DeviceCacheMode = DeviceCacheMode.ATTACH
    device: str = "cpu"
    num_host_blocks: int = 64
    staging_blocks: int = 16  # per storage direction (save, load)
    storage: dict[str, Any] = field(default_factory=lambda: {"backend": "file"})
    namespace: str = "default"
    model_dir: str | None = None
    version: str | None = None  # None: read <model_dir>/version.yaml
    endpoint: str = ""  # default: ipc:// socket in a 0700 directory
    engine_timeout_s: float = ENGINE_TIMEOUT_S  # silence after the engine's first hello
    start_timeout_s: float = START_TIMEOUT_S  # exit when no engine has said hello by then
    free_host_pool_on_sleep: bool = False
    metrics_port: int | None = None  # Prometheus exporter on 127.0.0.1 (0: any free port)
    log_level: str = "INFO"
    parent_pid: int | None = None  # exit as soon as this process (the launcher) is gone
    auth_key_file: str | None = None  # the instance secret; required on tcp:// endpoints
    cpu_cores: str | None = None  # a CPU list ("1", "0,2-3"); default: the cores it started on

    def __post_init__(self) -> None:
        check_instance_id(self.instance_id)
        _int_at_least("world_size", self.world_size, 1)
        _int_at_least("rank", self.rank, 0)
        if self.rank >= self.world_size:
            raise ConfigError("rank", f"{self.rank} must be < world_size {self.world_size}")
        try:
            object.__setattr__(self, "device_cache_mode", DeviceCacheMode(self.device_cache_mode))
        except ValueError:
            allowed = ", ".join(m.value for m in DeviceCacheMode)
            raise ConfigError(
                "device_cache_mode", f"got {self.device_cache_mode!r}; allowed: {allowed}"
            ) from None
        _int_at_least("num_host_blocks", self.num_host_blocks, 1)
        _int_at_least("staging_blocks", self.staging_blocks, 1)
        if not isinstance(self.storage, Mapping):
            raise ConfigError("storage", "must be a mapping with a 'backend' key")
        for name in ("engine_timeout_s", "start_timeout_s"):
            positive(name, getattr(self, name))
        if self.endpoint and not self.endpoint.startswith(
            ("ipc:///", "tcp://127.", "tcp://[::1]", LOCAL_SCHEME)
        ):
            raise ConfigError(
                "endpoint",
                "must be ipc:///ABSOLUTE/PATH (a file, not an abstract socket) or tcp on "
                f"loopback (tcp://127.0.0.1:PORT), got {self.endpoint!r}",
            )
        if self.endpoint.startswith("tcp://") and not self.auth_key_file:
            raise ConfigError(
                "auth_key_file",
                "a tcp:// endpoint is open to every local user: give the worker a secret "
                "(a 0600 file of 32 random bytes in hex) or use an ipc:// endpoint",
            )
        if self.metrics_port is not None:
            _int_at_least("metrics_port", self.metrics_port, 0)
            if self.metrics_port > 65535:
                raise ConfigError("metrics_port", f"must be <= 65535, got {self.metrics_port}")
        if self.cpu_cores is not None:
            parse_cpu_list(self.cpu_cores)
        if not re.fullmatch(r"cpu|cuda(:\d+)?", str(self.device)):
            raise ConfigError("device", f"got {self.device!r}; allowed: cpu, cuda, cuda:N")
        if str(self.log_level).upper() not in LOG_LEVELS:
            raise ConfigError(
                "log_level", f"got {self.log_level!r}; allowed: {', '.join(LOG_LEVELS)}"
            )
        from kvtier.layout.keys import KeyScheme

        KeyScheme(self.namespace, self.spec.fingerprint, self.rank, self.version or "")
        _ = self.storage_config  # parsed, so checked, now

    @functools.cached_property
    def storage_config(self) -> StorageConfig:
        """``storage`` in its typed form (parsed once, by ``__post_init__``)."""
        return parse_storage(self.storage)

    @property
    def device_cache_name(self) -> str:
        from kvtier.memory.device import cache_name

        return self.device_cache or cache_name(self.instance_id, self.rank)

    @property
    def endpoint_address(self) -> str:
        return self.endpoint or endpoint_for(self.instance_id, self.rank)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["spec"] = self.spec.to_dict()
        d["device_cache_mode"] = self.device_cache_mode.value
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerConfig:
        refuse_unknown(data, (f.name for f in dataclasses.fields(cls)), what="worker setting")
        if "spec" not in data:
            raise ConfigError("spec", "is required (a mapping, or the old engine's cache flags)")
        if "instance_id" not in data:
            raise ConfigError("instance_id", "is required")
        values = dict(data)
        spec = values["spec"]
        values["spec"] = spec if isinstance(spec, KVCacheSpec) else KVCacheSpec.from_dict(spec)
        return cls(**values)


def load_config(
    yaml_path: str | Path | None, overrides: Mapping[str, Any], environ: Mapping[str, str]
) -> WorkerConfig:
    """The YAML file, then ``KVTIER_<FIELD>`` variables, then ``overrides`` (the flags), field
    by field (see ``kvtier.common.config_sources``)."""
    sources = [yaml_source(yaml_path)] if yaml_path else []
    flags = Source("flags", overrides, labels=_flag_labels(overrides))
    return resolve([*sources, *env_sources(environ), flags])


def resolve(sources: Sequence[Source]) -> WorkerConfig:
    """The WorkerConfig of ``sources`` merged in order; a ConfigError names the value's source."""
    merged = merge(sources)
    try:
        return WorkerConfig.from_dict(merged.values)
    except ConfigError as e:
        raise merged.explain(e) from None


MAX_CONFIG_BYTES = 1 << 20  # a worker's settings are a few KiB; a spec with 10k layers fits


def yaml_source(path: str | Path) -> Source:
    """The settings in the YAML file ``path``, or on standard input for ``-`` (how a launcher
    hands a worker its config: no file another user could swap in a shared directory)."""
    name = "standard input" if str(path) == "-" else str(path)
    try:
        if str(path) == "-":
            text = sys.stdin.buffer.read(MAX_CONFIG_BYTES + 1)
        else:
            with open(path, "rb") as f:
                text = f.read(MAX_CONFIG_BYTES + 1)
        if len(text) > MAX_CONFIG_BYTES:
            raise ConfigError("config", f"{name} holds over {MAX_CONFIG_BYTES} bytes")
        loaded = yaml.safe_load(text) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError("config", f"cannot read {name}: {e}") from None
    if not isinstance(loaded, Mapping):
        raise ConfigError("config", f"{name} must hold a mapping")
    return Source(name, loaded)


def _flag_labels(overrides: Mapping[str, Any]) -> dict[str, str]:
    labels = {key: "--" + key.replace("_", "-") for key in overrides}
    labels.update({"storage.backend": "--storage-backend", "storage.root": "--storage-root"})
    return labels


# KVTIER_* variables read elsewhere (not worker settings): the MAC key (kvtier.storage), the
# bind guard's host (kvtier.common.bindguard), the test suite's requirements.
NOT_SETTINGS = frozenset({"KVTIER_STORAGE_MAC_KEY", "KVTIER_BIND_HOST", "KVTIER_TESTS_REQUIRE"})


def env_sources(environ: Mapping[str, str]) -> list[Source]:
    """The environment as sources: worker settings, and Mooncake options.

    ``KVTIER_<FIELD>`` sets a worker setting (``spec`` and ``storage`` as YAML or JSON mappings);
    ``KVTIER_STORAGE_BACKEND`` sets ``storage.backend``; ``KVTIER_MOONCAKE_<OPTION>`` sets
    ``storage.<option>`` when the storage is Mooncake (and is ignored otherwise). Variables that
    name no setting are reported with one warning each.
    """
    fields = {f.name: f.type for f in dataclasses.fields(WorkerConfig)}
    data: dict[str, Any] = {}
    labels: dict[str, str] = {}
    mooncake: dict[str, Any] = {}
    for name, text in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX) or name in NOT_SETTINGS:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if name.startswith(MOONCAKE_ENV_PREFIX):
            option = name[len(MOONCAKE_ENV_PREFIX) :].lower()
            mooncake[option] = _scalar(text)
            labels[f"storage.{option}"] = name
        elif key == "storage_backend":
            data.setdefault("storage", {})["backend"] = text
            labels["storage.backend"] = name
        elif key in ("spec", "storage"):
            data[key] = {**_mapping(name, text), **data.get(key, {})}
            labels[key] = name
        elif key in fields:
            data[key] = _coerce(key, text, fields[key])
            labels[key] = name
        else:
            log.warning(
                "%s is not a kvtier setting and is ignored; see `kvtier serve --help`", name
            )
    sources = [Source("the environment", data, labels)]
    if mooncake:
        sources.append(Source("the environment", {"storage": mooncake}, labels, "mooncake"))
    return sources


def _mapping(name: str, text: str) -> dict[str, Any]:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(name[len(ENV_PREFIX) :].lower(), f"{name} is not YAML: {e}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(
            name[len(ENV_PREFIX) :].lower(),
            f"{name} must be a YAML or JSON mapping, e.g. '{{backend: file, root: /data}}'",
        )
    return dict(value)


def _scalar(text: str) -> Any:
    """An int or float where the text is one, else the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _coerce(name: str, text: str, type_name: Any) -> Any:
    kind = str(type_name)
    try:
        if kind.startswith("int"):
            return int(text)
        if kind.startswith("float"):
            return float(text)
        if kind.startswith("bool"):
            lowered = text.strip().lower()
            if lowered not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError(text)
            return lowered in ("1", "true", "yes", "on")
    except ValueError:
        raise ConfigError(name, f"{ENV_PREFIX}{name.upper()}={text!r} is not a {kind}") from None
    return text


def _int_at_least(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(name, f"must be an integer >= {least}, got {value!r}")
