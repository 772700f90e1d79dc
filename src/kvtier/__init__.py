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
    "BlockCopier": "kvtier.copier",
    "make_copier": "kvtier.copier",
    "DeviceCache": "kvtier.device",
    "HostPool": "kvtier.host",
    "CacheDType": "kvtier.spec",
    "KVCacheSpec": "kvtier.spec",
    "KVLayout": "kvtier.spec",
    "Part": "kvtier.spec",
    "Client": "kvtier.client",
}

if TYPE_CHECKING:
    from kvtier.client import Client
    from kvtier.copier import BlockCopier, make_copier
    from kvtier.device import DeviceCache
    from kvtier.host import HostPool
    from kvtier.spec import CacheDType, KVCacheSpec, KVLayout, Part


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
