"""WorkerConfig: everything a worker needs, validated once; built from YAML, env and flags.

Precedence: command-line flags > ``KVTIER_*`` environment variables > the YAML file > defaults.
Errors are ``ConfigError`` naming the field. This module and the CLI are the only places that
read the process environment: library code takes the validated config.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvtier.errors import ConfigError
from kvtier.spec import KVCacheSpec

log = logging.getLogger(__name__)

ENV_PREFIX = "KVTIER_"
MOONCAKE_ENV_PREFIX = "KVTIER_MOONCAKE_"
DEVICE_CACHE_MODES = ("attach", "create")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
ENGINE_TIMEOUT_S = 30.0  # the old system waited 600 s before an orphaned manager gave up
LOCAL_SCHEME = "local://"  # in-process transport (tests, single-process engines)


def default_socket_dir() -> Path:
    """A private (0700, ours, not a link) directory for the workers' ipc:// sockets.

    ``$XDG_RUNTIME_DIR/kvtier-$UID``, or ``$TMPDIR/kvtier-$UID`` when XDG_RUNTIME_DIR is unset.
    A directory there that is a symbolic link, belongs to another user or is open to others is
    refused: another local user could otherwise run a fake worker on our socket path.
    """
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
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


def endpoint_for(instance_id: str, rank: int, socket_dir: Path | None = None) -> str:
    return f"ipc://{socket_dir or default_socket_dir()}/{instance_id}-rank{rank}.sock"


@dataclass(frozen=True)
class WorkerConfig:
    spec: KVCacheSpec
    instance_id: str
    rank: int = 0
    world_size: int = 1
    device_cache: str = ""  # name; default kvtier-{instance}-rank{rank}-dev0
    device_cache_mode: str = "attach"
    device: str = "cpu"
    num_host_blocks: int = 64
    staging_blocks: int = 16  # per storage direction (save, load)
    storage: dict[str, Any] = field(default_factory=lambda: {"backend": "file"})
    namespace: str = "default"
    model_dir: str | None = None
    version: str | None = None  # None: read <model_dir>/version.yaml
    endpoint: str = ""  # default: ipc:// socket in a 0700 directory
    engine_timeout_s: float = ENGINE_TIMEOUT_S
    free_host_pool_on_sleep: bool = False
    metrics_port: int | None = None  # Prometheus exporter on 127.0.0.1 (0: any free port)
    log_level: str = "INFO"
    parent_pid: int | None = None  # exit as soon as this process (the launcher) is gone
    auth_key_file: str | None = None  # the instance secret; required on tcp:// endpoints

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.instance_id or ""):
            raise ConfigError(
                "instance_id", f"must be 1-64 letters, digits, '._-', got {self.instance_id!r}"
            )
        _int_at_least("world_size", self.world_size, 1)
        _int_at_least("rank", self.rank, 0)
        if self.rank >= self.world_size:
            raise ConfigError("rank", f"{self.rank} must be < world_size {self.world_size}")
        if self.device_cache_mode not in DEVICE_CACHE_MODES:
            raise ConfigError(
                "device_cache_mode",
                f"got {self.device_cache_mode!r}; allowed: {', '.join(DEVICE_CACHE_MODES)}",
            )
        _int_at_least("num_host_blocks", self.num_host_blocks, 1)
        _int_at_least("staging_blocks", self.staging_blocks, 1)
        if not isinstance(self.storage, Mapping):
            raise ConfigError("storage", "must be a mapping with a 'backend' key")
        if not isinstance(self.engine_timeout_s, (int, float)) or self.engine_timeout_s <= 0:
            raise ConfigError("engine_timeout_s", f"must be > 0, got {self.engine_timeout_s!r}")
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
        if not re.fullmatch(r"cpu|cuda(:\d+)?", str(self.device)):
            raise ConfigError("device", f"got {self.device!r}; allowed: cpu, cuda, cuda:N")
        if str(self.log_level).upper() not in LOG_LEVELS:
            raise ConfigError(
                "log_level", f"got {self.log_level!r}; allowed: {', '.join(LOG_LEVELS)}"
            )
        from kvtier.keys import KeyScheme
        from kvtier.storage import validate_storage_config

        KeyScheme(self.namespace, self.spec.fingerprint, self.rank, self.version or "")
        validate_storage_config(self.storage)

    @property
    def device_cache_name(self) -> str:
        from kvtier.device import cache_name

        return self.device_cache or cache_name(self.instance_id, self.rank)

    @property
    def endpoint_address(self) -> str:
        return self.endpoint or endpoint_for(self.instance_id, self.rank)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["spec"] = self.spec.to_dict()
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown worker setting; allowed: {sorted(known)}")
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
    """YAML file, then ``KVTIER_<FIELD>`` variables, then ``overrides`` (the flags) win."""
    data: dict[str, Any] = {}
    if yaml_path:
        try:
            with open(yaml_path) as f:
                loaded = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError("config", f"cannot read {yaml_path}: {e}") from None
        if not isinstance(loaded, Mapping):
            raise ConfigError("config", f"{yaml_path} must hold a mapping")
        data.update(loaded)
    env_settings, storage_options = settings_from_env(environ)
    data.update(env_settings)
    data.update({k: v for k, v in overrides.items() if v is not None})
    if storage_options or "storage" in data:
        data["storage"] = merge_storage_options(data.get("storage") or {}, storage_options)
    return WorkerConfig.from_dict(data)


# KVTIER_* variables read elsewhere (not worker settings): the MAC key (kvtier.storage), the
# bind guard's host (kvtier.bindguard), the test suite's requirements.
NOT_SETTINGS = frozenset({"KVTIER_STORAGE_MAC_KEY", "KVTIER_BIND_HOST", "KVTIER_TESTS_REQUIRE"})


def settings_from_env(environ: Mapping[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(worker settings, storage options) from the environment.

    ``KVTIER_<FIELD>`` sets a worker setting (``spec`` and ``storage`` as YAML or JSON mappings);
    ``KVTIER_STORAGE_BACKEND`` and ``KVTIER_MOONCAKE_<OPTION>`` are storage options. Variables
    that name no setting are reported with one warning each.
    """
    fields = {f.name: f.type for f in dataclasses.fields(WorkerConfig)}
    data: dict[str, Any] = {}
    storage: dict[str, Any] = {}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX) or name in NOT_SETTINGS:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if name.startswith(MOONCAKE_ENV_PREFIX):
            storage[name[len(MOONCAKE_ENV_PREFIX) :].lower()] = _scalar(text)
        elif key == "storage_backend":
            storage["backend"] = text
        elif key in ("spec", "storage"):
            data[key] = _mapping(name, text)
        elif key in fields:
            data[key] = _coerce(key, text, fields[key])
        else:
            log.warning(
                "%s is not a kvtier setting and is ignored; see `kvtier serve --help`", name
            )
    return data, storage


def merge_storage_options(storage: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, Any]:
    """``storage`` with per-option environment values: ``backend`` from the environment wins;
    Mooncake options fill only what the mapping leaves out (the mapping wins)."""
    merged = dict(storage)
    if "backend" in options:
        merged["backend"] = options["backend"]
    if merged.get("backend") == "mooncake":
        for key, value in options.items():
            merged.setdefault(key, value)
    return merged


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
