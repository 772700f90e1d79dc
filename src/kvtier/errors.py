"""kvtier's one exception tree: everything kvtier raises derives from KvtierError."""

from __future__ import annotations


class KvtierError(Exception):
    """Base of every error kvtier raises."""


class ConfigError(KvtierError, ValueError):
    """A configuration value is invalid; the message names the field and the allowed values."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class InvalidBlockIds(KvtierError, ValueError):
    """Block id lists are unusable: unequal lengths, an id out of range, a duplicate destination."""


class LayoutMismatch(KvtierError):
    """Tensors or stored data do not match the KVCacheSpec they are used with."""


class DeviceCacheError(KvtierError):
    """A device cache could not be created, attached or used."""


class DeviceCacheDetached(DeviceCacheError):
    """The device cache is detached (sleeping); no block can be read or written."""


class StorageError(KvtierError):
    """A storage backend failed an operation."""


class StorageUnavailable(StorageError):
    """The storage backend cannot be reached; callers treat it as zero blocks stored."""


class ObjectCorrupt(StorageError):
    """A stored object failed its header or checksum check; it is treated as a miss."""


class WorkerError(KvtierError):
    """A worker could not be started, reached or used."""


class WorkerLost(WorkerError):
    """A worker died or stopped answering; its pending tasks fail with this."""


class TaskTimeout(WorkerError):
    """A task was not answered by every rank before its deadline."""


class ProtocolMismatch(WorkerError):
    """The worker speaks another protocol version."""
