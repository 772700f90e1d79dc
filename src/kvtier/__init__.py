"""kvtier: move LLM KV-cache blocks between device memory, a host pool and storage.

The names below are imported on first use, so ``import kvtier`` (and ``kvtier --help``) stays
fast and never imports torch, ZeroMQ or an engine until something needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvtier.errors import (
    ConfigError,
    DeviceCacheDetached,
    DeviceCacheError,
    InvalidBlockHash,
    InvalidBlockIds,
    InvalidInput,
    KvtierError,
    LayoutMismatch,
    NoFreeBlocks,
    ObjectCorrupt,
    ProtocolMismatch,
    StorageError,
    StorageUnavailable,
    TaskTimeout,
    UnsafeFile,
    WorkerError,
    WorkerLost,
)

__version__ = "0.1.0"

_LAZY = {
    "BlockCopier": "kvtier.memory.copier",
    "make_copier": "kvtier.memory.copier",
    "DeviceCache": "kvtier.memory.device",
    "HostPool": "kvtier.memory.host",
    "CacheDType": "kvtier.layout.spec",
    "KVCacheSpec": "kvtier.layout.spec",
    "KVLayout": "kvtier.layout.spec",
    "Part": "kvtier.layout.spec",
    "Client": "kvtier.engine.client",
}

if TYPE_CHECKING:
    from kvtier.engine.client import Client
    from kvtier.layout.spec import CacheDType, KVCacheSpec, KVLayout, Part
    from kvtier.memory.copier import BlockCopier, make_copier
    from kvtier.memory.device import DeviceCache
    from kvtier.memory.host import HostPool


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "BlockCopier",
    "CacheDType",
    "Client",
    "ConfigError",
    "DeviceCache",
    "DeviceCacheDetached",
    "DeviceCacheError",
    "HostPool",
    "InvalidBlockHash",
    "InvalidBlockIds",
    "InvalidInput",
    "KVCacheSpec",
    "KVLayout",
    "KvtierError",
    "LayoutMismatch",
    "NoFreeBlocks",
    "ObjectCorrupt",
    "Part",
    "ProtocolMismatch",
    "StorageError",
    "StorageUnavailable",
    "TaskTimeout",
    "UnsafeFile",
    "WorkerError",
    "WorkerLost",
    "make_copier",
]
