"""Delegating: the base of a store that wraps another (the fault injector, a tier chain).

Every part of the interface goes to ``inner`` unless the wrapper overrides it; the format, the
counters and the block sizes are the inner store's own objects (a wrapper keeps no second copy
to keep in step). ``wrapped`` names the backend under every wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.layout.spec import KVCacheSpec
from kvtier.storage.base import (
    Promotes,
    Read,
    ReadResult,
    ScatteredIO,
    StorageBackend,
    StorageStats,
    StorageUsage,
)
from kvtier.storage.format import ObjectFormat


class Delegating(StorageBackend):
    def __init__(self, inner: StorageBackend) -> None:
        self.inner = inner

    # ---- what the inner store names ----------------------------------------------------------

    @property
    def spec(self) -> KVCacheSpec:  # type: ignore[override]
        return self.inner.spec

    @property
    def format(self) -> ObjectFormat:
        return self.inner.format

    @format.setter
    def format(self, value: ObjectFormat) -> None:
        self.inner.format = value

    @property
    def stats(self) -> StorageStats:  # type: ignore[override]
        return self.inner.stats

    @property
    def payload_bytes(self) -> int:  # type: ignore[override]
        return self.inner.payload_bytes

    @property
    def object_bytes(self) -> int:  # type: ignore[override]
        return self.inner.object_bytes

    @property
    def fingerprint(self) -> str:
        return self.inner.spec.fingerprint

    @property
    def quick_lookups(self) -> bool:  # type: ignore[override]
        return self.inner.quick_lookups

    @property
    def exposes_registered_memory(self) -> bool:
        return self.inner.exposes_registered_memory

    @property
    def persistent(self) -> bool:
        return self.inner.persistent

    def scattered(self) -> ScatteredIO | None:
        return self.inner.scattered()

    def promoter(self) -> Promotes | None:
        return self.inner.promoter()

    @property
    def wrapped(self) -> StorageBackend:
        return self.inner.wrapped

    # ---- data ----------------------------------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        return self.inner.exists_prefix(keys)

    def holds(self, key: str) -> bool:
        return self.inner.holds(key)

    def prefix_tiers(self, keys: Sequence[str]) -> tuple[int, bytes]:
        return self.inner.prefix_tiers(keys)

    def read(self, request: Read) -> ReadResult:
        return self.inner.read(request)

    def put_from(self, keys, host_blocks, checksums=None, originals=None) -> list[bool]:
        return self.inner.put_from(keys, host_blocks, checksums, originals)

    def delete(self, keys: Sequence[str]) -> int:
        return self.inner.delete(keys)

    def usage(self) -> StorageUsage:
        return self.inner.usage()

    def read_object(self, key: str) -> bytes | None:
        return self.inner.read_object(key)

    def write_object(self, key: str, data: bytes) -> None:
        self.inner.write_object(key, data)

    def found_corrupt(self, key: str) -> bool:
        return self.inner.found_corrupt(key)

    def report_corrupt(self, key: str, reason: str) -> None:
        self.inner.report_corrupt(key, reason)

    def watch_removals(self, listener: Callable[[list[str]], None]) -> None:
        self.inner.watch_removals(listener)

    def tier_stats(self) -> list[dict]:
        return self.inner.tier_stats()

    def register_host_pool(self, pool, blocks: range | None = None) -> None:
        self.inner.register_host_pool(pool, blocks)

    def unregister_host_pool(self, pool) -> None:
        self.inner.unregister_host_pool(pool)

    def close(self) -> None:
        self.inner.close()
