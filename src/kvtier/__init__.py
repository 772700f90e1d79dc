"""kvtier: move LLM KV-cache blocks between device memory, a host pool and storage."""

from kvtier.copier import BlockCopier, make_copier
from kvtier.device import DeviceCache
from kvtier.errors import (
    ConfigError,
    DeviceCacheDetached,
    DeviceCacheError,
    InvalidBlockIds,
    KvtierError,
    LayoutMismatch,
    StorageError,
    StorageUnavailable,
)
from kvtier.host import HostPool
from kvtier.spec import CacheDType, KVCacheSpec, Part

__version__ = "0.1.0"

__all__ = [
    "BlockCopier",
    "CacheDType",
    "ConfigError",
    "DeviceCache",
    "DeviceCacheDetached",
    "DeviceCacheError",
    "HostPool",
    "InvalidBlockIds",
    "KVCacheSpec",
    "KvtierError",
    "LayoutMismatch",
    "Part",
    "StorageError",
    "StorageUnavailable",
    "make_copier",
]
