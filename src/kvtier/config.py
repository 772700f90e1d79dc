"""WorkerConfig: everything a worker needs, validated once; built from YAML, env and flags.

Precedence: command-line flags > ``KVTIER_*`` environment variables > the YAML file > defaults.
Errors are ``ConfigError`` naming the field.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kvtier.errors import ConfigError
from kvtier.spec import KVCacheSpec

ENV_PREFIX = "KVTIER_"
DEVICE_CACHE_MODES = ("attach", "create")
ENGINE_TIMEOUT_S = 30.0  # the old system waited 600 s before an orphaned manager gave up


def default_socket_dir() -> Path:
    """A 0700 directory for the workers' ipc:// sockets."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = Path(base) / f"kvtier-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)
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
        if self.endpoint and not self.endpoint.startswith(("ipc://", "tcp://127.", "tcp://[::1]")):
            raise ConfigError(
                "endpoint",
                "must be ipc://PATH or tcp on loopback "
                f"(tcp://127.0.0.1:PORT), got {self.endpoint!r}",
            )
        if self.metrics_port is not None:
            _int_at_least("metrics_port", self.metrics_port, 0)
        if not self.device.startswith(("cpu", "cuda")):
            raise ConfigError("device", f"got {self.device!r}; allowed: cpu, cuda, cuda:N")

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
    for f in dataclasses.fields(WorkerConfig):
        env_name = ENV_PREFIX + f.name.upper()
        if env_name in environ and f.name not in ("spec", "storage"):
            data[f.name] = _coerce(f.name, environ[env_name], f.type)
    if ENV_PREFIX + "STORAGE_BACKEND" in environ:
        data["storage"] = {
            **data.get("storage", {}),
            "backend": environ[ENV_PREFIX + "STORAGE_BACKEND"],
        }
    data.update({k: v for k, v in overrides.items() if v is not None})
    return WorkerConfig.from_dict(data)


def _coerce(name: str, text: str, type_name: Any) -> Any:
    kind = str(type_name)
    try:
        if kind.startswith("int"):
            return int(text)
        if kind.startswith("float"):
            return float(text)
        if kind.startswith("bool"):
            return text.strip().lower() in ("1", "true", "yes", "on")
    except ValueError:
        raise ConfigError(name, f"{ENV_PREFIX}{name.upper()}={text!r} is not a {kind}") from None
    return text


def _int_at_least(name: str, value: Any, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(name, f"must be an integer >= {least}, got {value!r}")
