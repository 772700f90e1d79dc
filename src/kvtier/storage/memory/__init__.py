"""The memory backend: a dict of objects (unbounded, ``store``) or a preallocated slab evicting
least recently used objects (``arena`` over ``arena_memory``: the memory tier of a chain)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtier.storage.config import MemoryConfig

if TYPE_CHECKING:
    from kvtier.layout.spec import KVCacheSpec
    from kvtier.storage.base import StorageBackend


def parse_options(data: Mapping[str, Any]) -> MemoryConfig:
    return MemoryConfig.from_dict(data)


def open_backend(spec: KVCacheSpec, options: MemoryConfig, mac_key: bytes | None) -> StorageBackend:
    if options.capacity_bytes is None:
        from kvtier.storage.memory.store import MemoryStore

        return MemoryStore(spec, mac_key=mac_key)
    from kvtier.storage.memory.arena import ArenaStore  # a preallocated slab

    return ArenaStore(spec, options.capacity_bytes, mac_key=mac_key)
