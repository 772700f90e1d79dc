"""kvtier's one exception tree: everything kvtier raises derives from KvtierError.

::

    KvtierError
    ├── ConfigError            a setting is invalid (names the field and the allowed values)
    ├── InvalidInput           an argument of a call or a task is unusable
    │   ├── InvalidBlockIds    unequal lengths, an id out of range, a duplicate destination
    │   └── InvalidBlockHash   a block hash of the wrong length or type
    ├── LayoutMismatch         tensors or stored data do not match the KVCacheSpec
    ├── DeviceCacheError       a device cache could not be created, attached or used
    │   ├── DeviceCacheDetached    (sleeping)
    │   └── UnsafeFile         a file found by name failed its owner / mode / type check
    ├── NoFreeBlocks           the engine-side index has no device block it may reuse
    ├── StorageError           a storage backend failed an operation
    │   ├── StorageUnavailable     the backend cannot be reached (callers count 0 blocks)
    │   └── ObjectCorrupt      a stored object failed its checks (a miss)
    └── WorkerError            a worker could not be started, reached or used
        ├── WorkerLost         a worker died or stopped answering
        ├── TaskTimeout        a task was not answered in time
        ├── DeadlinePassed     (in a worker) a task's client may have given up: left alone
        ├── ProtocolMismatch   the worker speaks another protocol version
        └── PeerNotVerified    the peer on a tcp:// endpoint did not prove it is the worker
"""

from __future__ import annotations


class KvtierError(Exception):
    """Base of every error kvtier raises."""


class ConfigError(KvtierError, ValueError):
    """A configuration value is invalid; the message names the field and the allowed values."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


class InvalidInput(KvtierError, ValueError):
    """An argument of a call or a task is unusable (not a setting: the caller passed it)."""


class InvalidBlockIds(InvalidInput):
    """Block id lists are unusable: unequal lengths, an id out of range, a duplicate destination."""


class InvalidBlockHash(InvalidInput):
    """A block hash is not bytes of an accepted length."""


class LayoutMismatch(KvtierError):
    """Tensors or stored data do not match the KVCacheSpec they are used with."""


class DeviceCacheError(KvtierError):
    """A device cache could not be created, attached or used."""


class DeviceCacheDetached(DeviceCacheError):
    """The device cache is detached (sleeping); no block can be read or written."""


class UnsafeFile(DeviceCacheError):
    """A file kvtier opened by name is not ours (owner), is shared (mode) or not a regular file."""


class NoFreeBlocks(KvtierError):
    """Every device block is held by running requests: finish some first."""


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


class DeadlinePassed(WorkerError):
    """A worker left a task's blocks alone: its client's deadline passed (``worker.deadline``)."""


class ProtocolMismatch(WorkerError):
    """The worker speaks another protocol version."""


class PeerNotVerified(WorkerError):
    """The peer listening on a ``tcp://`` endpoint did not prove that it holds the instance
    secret (a worker started with another ``auth_key_file``, or an impostor on the port)."""
