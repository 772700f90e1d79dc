"""ObjectStore: what every backend that holds kvtier's objects itself shares.

The interface is ``kvtier.storage.base``; this is the helper base under the built-in backends
(file, memory, Mooncake, S3) and any out-of-tree one that wants it: the object format and its
checks, the counters, the corrupt keys a load asks about, the removal listener, and the
argument checks every backend makes. A backend implements ``_read`` (a ``Read`` into host
blocks, filling a ``ReadResult``); ``read`` checks the request and counts it.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from kvtier.errors import ObjectCorrupt, StorageError
from kvtier.layout.spec import KVCacheSpec
from kvtier.storage.base import (
    GoOn,
    Read,
    ReadResult,
    ScatteredIO,
    StorageBackend,
    StorageStats,
)
from kvtier.storage.format import HEADER_BYTES, ObjectFormat

# Bad keys kept for a load to ask about (it asks at once: a few suffice; bounded all the same).
REMEMBERED_CORRUPT_KEYS = 1024

log = logging.getLogger(__name__)


class ObjectStore(StorageBackend):
    """A backend whose objects are kvtier's own format (header, checksum or MAC, payload)."""

    def __init__(self, spec: KVCacheSpec, mac_key: bytes | None = None) -> None:
        self.spec = spec
        self.fingerprint = spec.fingerprint
        self.format = ObjectFormat(spec.fingerprint, mac_key)
        self.payload_bytes = spec.block_bytes
        self.object_bytes = HEADER_BYTES + spec.block_bytes
        self.stats = StorageStats()
        self._found_corrupt: OrderedDict[str, None] = OrderedDict()  # until a load asks
        self._removal_listener: Callable[[list[str]], None] | None = None

    # ---- reads -----------------------------------------------------------------------------

    def read(self, request: Read) -> ReadResult:
        self._check_batch(request.keys, request.host_blocks)
        result = ReadResult.empty(request)
        self._read(request, result)
        if request.counted:
            self._count_gets(result.found)
        return result

    @abstractmethod
    def _read(self, request: Read, result: ReadResult) -> None:
        """Fill ``request.host_blocks`` and ``result`` (``found``; ``checksums`` and
        ``headers`` where they are not None: the caller verifies). Arguments are checked."""

    # ---- bad objects and removals ----------------------------------------------------------

    def watch_removals(self, listener: Callable[[list[str]], None]) -> None:
        self._removal_listener = listener

    def _evicted(self, keys: list[str]) -> None:
        if keys and self._removal_listener is not None:
            self._removal_listener(keys)

    def found_corrupt(self, key: str) -> bool:
        with self.stats.lock:
            if key not in self._found_corrupt:
                return False
            del self._found_corrupt[key]
            return True

    def report_corrupt(self, key: str, reason: str) -> None:
        self._corrupt(key, ObjectCorrupt(reason))
        self.delete([key])

    def _corrupt(self, key: str, error: ObjectCorrupt) -> None:
        """Count and log a detected bad object once; the caller removes it."""
        self.stats.add(corrupt=1)
        with self.stats.lock:
            self._found_corrupt[key] = None
            while len(self._found_corrupt) > REMEMBERED_CORRUPT_KEYS:
                self._found_corrupt.popitem(last=False)
        log.warning(
            "%s store: object %s is corrupt (%s): treated as a miss and removed",
            self.kind,
            key,
            error,
        )

    # ---- argument checks and counters --------------------------------------------------------

    def _check_batch(
        self, keys: Sequence[str], host_blocks: Sequence[torch.Tensor], checksums=None
    ) -> None:
        check_batch(keys, host_blocks, self.payload_bytes, checksums)

    def _check_scattered(self, keys: Sequence[str], targets) -> None:
        check_scattered(keys, targets, self.payload_bytes)

    def _count_gets(self, results: list[bool]) -> list[bool]:
        hits = sum(results)
        self.stats.add(hits=hits, misses=len(results) - hits)
        return results

    def _count_puts(self, results: list[bool]) -> list[bool]:
        ok = sum(results)
        self.stats.add(puts=ok, put_failures=len(results) - ok)
        return results


class ScatteredObjectStore(ObjectStore):
    """An ObjectStore that reads into and writes from a CPU device block's pieces itself (the
    file and memory stores): its own ``ScatteredIO``, over every object it holds."""

    covers_all = True

    def scattered(self) -> ScatteredIO:
        return self

    @abstractmethod
    def get_into_scattered(
        self,
        keys: Sequence[str],
        targets: Sequence[Sequence[memoryview]],
        go_on: GoOn | None = None,
    ) -> list[bool]:
        """``ScatteredIO.get_into_scattered`` (``kvtier.storage.base``)."""

    @abstractmethod
    def put_from_scattered(
        self, keys: Sequence[str], sources: Sequence[Sequence[memoryview]]
    ) -> list[bool]:
        """``ScatteredIO.put_from_scattered`` (``kvtier.storage.base``)."""


def check_batch(
    keys: Sequence[str], host_blocks: Sequence[torch.Tensor], payload_bytes: int, checksums=None
) -> None:
    """A key per block (and per checksum, where given), each key a non-empty string, each
    block as ``check_blocks`` wants it."""
    if len(keys) != len(host_blocks):
        raise StorageError(f"{len(keys)} keys but {len(host_blocks)} host blocks")
    if checksums is not None and len(checksums) != len(keys):
        raise StorageError(f"{len(keys)} keys but {len(checksums)} checksums")
    check_blocks(host_blocks, payload_bytes)
    for key in keys:
        if not isinstance(key, str) or not key:
            raise StorageError(f"keys must be non-empty strings, got {key!r}")


def check_blocks(host_blocks: Sequence[torch.Tensor], payload_bytes: int) -> None:
    """Each block a contiguous CPU uint8 tensor of ``payload_bytes`` (``HostPool.block(i)``)."""
    for i, block in enumerate(host_blocks):
        if block.dtype != torch.uint8 or block.numel() != payload_bytes:
            raise StorageError(
                f"host block {i} is {block.numel()} x {block.dtype}; need "
                f"{payload_bytes} x torch.uint8 (HostPool.block(i))"
            )
        if not block.is_contiguous() or block.device.type != "cpu":
            raise StorageError(f"host block {i} must be a contiguous CPU tensor")


def check_buffers(
    keys: Sequence[str], buffers: Sequence[memoryview], payload_bytes: int, writable: bool
) -> None:
    """One buffer per key, each a C-contiguous byte memoryview of ``payload_bytes``, writable
    where it is to be filled (``StartsTransfers``)."""
    if len(keys) != len(buffers):
        raise StorageError(f"{len(keys)} keys but {len(buffers)} buffers")
    for i, buf in enumerate(buffers):
        if not isinstance(buf, memoryview) or buf.nbytes != payload_bytes or buf.format != "B":
            raise StorageError(f"buffer {i} must be a byte memoryview of {payload_bytes} bytes")
        if not buf.c_contiguous or (writable and buf.readonly):
            raise StorageError(f"buffer {i} must be contiguous" + (" and writable" * writable))


def check_scattered(keys: Sequence[str], targets, payload_bytes: int | None) -> None:
    """One target per key, each ``payload_bytes`` long in its pieces (None: lengths only)."""
    if len(keys) != len(targets):
        raise StorageError(f"{len(keys)} keys but {len(targets)} targets")
    for i, views in enumerate(targets if payload_bytes is not None else ()):
        if sum(map(len, views)) != payload_bytes:  # map: no Python frame per view
            raise StorageError(f"target {i} holds {sum(map(len, views))} bytes")
