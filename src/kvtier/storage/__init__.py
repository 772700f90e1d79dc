"""Storage tier: backends behind one contract, and the factory that builds them from config."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtier.config_sources import refuse_unknown
from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.spec import KVCacheSpec
    from kvtier.storage.base import StorageBackend, StorageStats, StorageUsage

BACKENDS = ("file", "mooncake", "memory")

__all__ = [
    "BACKENDS",
    "StorageBackend",
    "StorageStats",
    "StorageUsage",
    "make_backend",
    "validate_storage_config",
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


def validate_storage_config(config: Mapping[str, Any]) -> None:
    """Check a storage mapping without connecting to or creating anything (ConfigError)."""
    options = dict(config)
    kind = options.pop("backend", "file")
    faults = options.pop("faults", None)
    mac_key_file = options.pop(MAC_KEY_FILE, None)
    if mac_key_file is not None and not isinstance(mac_key_file, str):
        raise ConfigError(f"storage.{MAC_KEY_FILE}", f"must be a path, got {mac_key_file!r}")
    if kind == "file":
        from kvtier.storage.file_config import FileStoreConfig

        FileStoreConfig.from_dict(options)
    elif kind == "mooncake":
        from kvtier.storage.mooncake_setup import MooncakeConfig

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
    """Build a backend from ``{"backend": "file" | "mooncake" | "memory", ...options}``.

    A ``faults`` mapping in the config wraps the backend in a FaultInjectingStore;
    ``mac_key_file`` (or ``$KVTIER_STORAGE_MAC_KEY``, hex) makes every object authenticated.
    """
    options = dict(config or {"backend": "file"})
    kind = options.pop("backend", "file")
    faults = options.pop("faults", None)
    mac_key = read_mac_key(options.pop(MAC_KEY_FILE, None))
    if kind == "file":
        from kvtier.storage.file import FileStore

        backend: StorageBackend = FileStore(spec, options, mac_key=mac_key)
    elif kind == "mooncake":
        from kvtier.storage.mooncake import MooncakeStore

        backend = MooncakeStore(spec, options, mac_key=mac_key)
    elif kind == "memory":
        from kvtier.storage.memory import MemoryStore

        backend = MemoryStore(spec, _memory_options(options), mac_key=mac_key)
    else:
        raise ConfigError("storage.backend", f"got {kind!r}; allowed: {', '.join(BACKENDS)}")
    if faults:
        from kvtier.storage.faults import FaultInjectingStore

        backend = FaultInjectingStore(backend, faults)
    return backend


def read_mac_key(path: str | None) -> bytes | None:
    """The MAC key: from ``path`` (a 0600 file of this user, hex), else from the environment."""
    from kvtier import auth

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
