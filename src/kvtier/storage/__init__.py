"""Storage tier: backends behind one contract, and the factory that builds them from config."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.errors import ConfigError
from kvtier.spec import KVCacheSpec
from kvtier.storage.base import StorageBackend, StorageStats, StorageUsage

BACKENDS = ("file", "mooncake", "memory")

__all__ = ["BACKENDS", "StorageBackend", "StorageStats", "StorageUsage", "make_backend"]


def make_backend(spec: KVCacheSpec, config: Mapping[str, Any] | None = None) -> StorageBackend:
    """Build a backend from ``{"backend": "file" | "mooncake" | "memory", ...options}``.

    A ``faults`` mapping in the config wraps the backend in a FaultInjectingStore.
    """
    options = dict(config or {"backend": "file"})
    kind = options.pop("backend", "file")
    faults = options.pop("faults", None)
    if kind == "file":
        from kvtier.storage.file import FileStore

        backend: StorageBackend = FileStore(spec, options)
    elif kind == "mooncake":
        from kvtier.storage.mooncake import MooncakeStore

        backend = MooncakeStore(spec, options)
    elif kind == "memory":
        from kvtier.storage.memory import MemoryStore

        unknown = sorted(set(options) - {"capacity_bytes"})
        if unknown:
            raise ConfigError(
                f"storage.{unknown[0]}",
                "unknown option for the memory backend; allowed: ['capacity_bytes']",
            )
        backend = MemoryStore(spec, options.get("capacity_bytes"))
    else:
        raise ConfigError("storage.backend", f"got {kind!r}; allowed: {', '.join(BACKENDS)}")
    if faults:
        from kvtier.storage.faults import FaultInjectingStore

        backend = FaultInjectingStore(backend, faults)
    return backend
