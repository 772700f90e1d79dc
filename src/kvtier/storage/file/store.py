"""FileStore: the embedded default — one checksummed file per object, crash-safe, LRU-capped.

On-disk layout under ``root``::

    objects/<2 hex>/<sha256(key) hex>.kvb   one object: 64-byte header + page-first block + key
    objects/<2 hex>/<pid>-<thread>-<n>.tmp   writes in progress (never read)

A write goes to a temporary file beside its object, then ``rename()`` within that directory
publishes it atomically: a crash at any point leaves either no object or the whole object, never
a visible partial one. (A rename across directories — the former ``tmp/`` — takes the file
system's rename lock and journals two directories: it halved the save rate.) Temporary files of
dead writers are removed at the next start (and any in the former ``tmp/``). Below the root
every file is reached through directory descriptors, never through a link (``file_dirs``,
``file_objects``): a member of a shared store who swaps a directory for a link cannot aim
writes, reads or deletions outside the root (a private store keeps its fan-out descriptors
open: nobody else can swap them). Reads go straight into the host block (header into a small
buffer, payload into the block: no extra copy) and check every header field and the payload
checksum; a bad object is removed and reported as a miss. An object is read, or written, in
one call without the GIL (``file_io.read_object``, native where ``kvtier._fileio`` is built),
its payload hashed chunk by chunk as it lands: with four I/O threads the GIL hand-offs of nine
Python system calls per object, not the disk, had set the pace (a warm verified load ran at
0.53x a raw read).

Capacity: with ``capacity_bytes`` set, least-recently-used objects are removed once the total
exceeds it. Recency is the file's mtime (bumped on every read), so the index rebuilt from the
directory at start keeps the order, and several processes sharing one directory see each
other's accesses; a process rescans the directory before it evicts (at most every
``RESCAN_INTERVAL_S``) so that it counts the other processes' objects too.

fsync policy (``fsync``):
- ``none`` (default): no fsync. A process crash never exposes a partial object (rename is
  atomic); a power loss can lose recent objects or leave torn ones, which the checksum turns into
  misses. KV blocks can always be recomputed, so durability is not worth 1-2 GB/s here.
- ``data``: fdatasync each object before its rename: objects that were reported stored survive a
  power loss, at disk-flush speed.
- ``full``: ``data`` plus an fsync of the directory after the rename, so the name survives too.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvtier.errors import ObjectCorrupt, StorageError
from kvtier.layout.spec import KVCacheSpec
from kvtier.storage.base import Done, Read, ReadResult, StorageUsage
from kvtier.storage.file.config import FileStoreConfig
from kvtier.storage.file.dirs import FANOUT_DIRS, StoreDirs, fanout_name, object_name
from kvtier.storage.file.index import LruIndex
from kvtier.storage.file.io import (
    CallersPriorityPool,
    OnceLog,
    striped,
    striped_async,
    warn_if_open,
    zero,
)
from kvtier.storage.file.objects import MAX_KEY_BYTES, ObjectFiles
from kvtier.storage.format import HEADER_BYTES
from kvtier.storage.object_store import ScatteredObjectStore, check_buffers

log = logging.getLogger(__name__)

# A read refreshes an object's mtime (its LRU recency) only when it is older than this.
RECENCY_GRANULARITY_S = 2.0
# Batches at least this large are spread over the I/O threads; smaller ones run inline (thread
# hand-offs cost milliseconds on a busy 2-core machine: measured 17 ms vs 0.8 ms for 8 x 64 KiB;
# 15 x 1 MiB read 1.7x faster on two threads than inline).
PARALLEL_MIN_BYTES = 4 << 20


class FileStore(ScatteredObjectStore):
    kind = "file"
    exposes_registered_memory = False
    persistent = True

    def __init__(
        self,
        spec: KVCacheSpec,
        config: FileStoreConfig | Mapping[str, Any] | None = None,
        *,
        mac_key: bytes | None = None,
    ):
        super().__init__(spec, mac_key)
        if not isinstance(config, FileStoreConfig):
            config = FileStoreConfig.from_dict(config or {})
        self.config = config
        self.root = config.root
        self._dirs = StoreDirs(self.root, config.permissions.dir_mode)
        self._index = LruIndex()
        self._warn_once = OnceLog(f"file store {self.root}")
        self._files = ObjectFiles(self._dirs, config, self._warn_once)
        try:
            self._dirs.open()
        except OSError as e:
            self._dirs.close()
            raise StorageError(f"cannot create the file store in {self.root}: {e}") from e
        warn_if_open(self.root, config.permissions)
        try:
            for name in self._dirs.remove_dead_tmp_files():
                log.info("file store: removed %s left by a writer that died", name)
        except (OSError, StorageError) as e:
            self._warn_once("clean tmp", e)
        self._rescan()
        self._pool = ThreadPoolExecutor(config.io_threads, thread_name_prefix="kvtier-file")
        self._writers = CallersPriorityPool(config.io_threads, "kvtier-file-write")

    # ---- contract ---------------------------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        """Counts an object only if its header is sound (64 bytes read per key, no payload)."""
        for n, key in enumerate(keys):
            if not self._header_ok(key):
                return n
        return len(keys)

    def _read(self, request: Read, result: ReadResult) -> None:
        fn = functools.partial(
            self._get_one, checksums_out=result.checksums, headers_out=result.headers, block=True
        )
        # Each block's buffer is taken here, not on the I/O threads: ``Tensor.numpy`` there
        # waited on the GIL beside the other threads' reads (32 x 256 KiB: 3.0 ms -> 2.3).
        views = [[block.numpy().data] for block in request.host_blocks]
        result.found[:] = self._striped(fn, request.keys, views)

    def starts_transfers(self) -> FileStore:
        return self

    def start_read(self, keys: Sequence[str], buffers: Sequence[memoryview], done: Done) -> None:
        """``StartsTransfers``: read on the I/O threads (all of them for a large batch, one
        for a small one), the last to finish answers."""
        check_buffers(keys, buffers, self.payload_bytes, writable=True)
        fn = functools.partial(self._get_one, block=True)  # verified here, as it is read

        def finished(found: list[bool], error: BaseException | None) -> None:
            if error is None:
                self._count_gets(found)
            done(found if error is None else None, error)

        threads = self.config.io_threads if self._large(keys) else 1
        striped_async(self._pool, threads, fn, keys, [[buf] for buf in buffers], finished)

    def start_write(self, keys: Sequence[str], buffers: Sequence[memoryview], done: Done) -> None:
        """``StartsTransfers``: ``put_from`` on the writers (all of them for a large batch,
        one for a small one), the last to finish answers (after evicting, as ``put_from``)."""
        check_buffers(keys, buffers, self.payload_bytes, writable=False)

        def finished(stored: list[bool], error: BaseException | None) -> None:
            if error is None:
                try:
                    self._count_puts(stored)
                    self._evict_if_needed()
                except Exception as e:
                    error = e
            done(stored if error is None else None, error)

        threads = self.config.io_threads if self._large(keys) else 1
        views = [[buf] for buf in buffers]
        striped_async(self._writers.get(), threads, self._put_one, keys, views, finished)

    def get_into_scattered(self, keys, targets, go_on=None) -> list[bool]:
        self._check_scattered(keys, targets)
        fn = functools.partial(self._get_one, go_on=go_on)
        return self._count_gets(self._striped(fn, keys, targets, prefix=True))

    def put_from_scattered(self, keys, sources) -> list[bool]:
        self._check_scattered(keys, sources)
        results = self._count_puts(
            [self._put_one(i, k, s) for i, (k, s) in enumerate(zip(keys, sources))]
        )
        self._evict_if_needed()
        return results

    def put_from(self, keys, host_blocks, checksums=None, originals=None) -> list[bool]:
        self._check_batch(keys, host_blocks, checksums)
        if originals is not None:  # the same bytes where no peer can write them
            return self.put_from_scattered(keys, originals)
        fn = functools.partial(self._put_one, checksums=checksums)
        # Large batches are written by ``io_threads`` threads (one thread reached half the
        # rate of a raw write with as many threads), at the priority of the thread that made
        # the first large put: a worker's background save thread's.
        pool = self._writers.get() if self._large(keys) else None
        views = [[block.numpy().data] for block in host_blocks]  # here: as ``_read``
        results = self._count_puts(striped(pool, self.config.io_threads, fn, keys, views))
        self._evict_if_needed()
        return results

    def delete(self, keys: Sequence[str]) -> int:
        return sum(self._remove(*object_name(key)) for key in keys)

    def usage(self) -> StorageUsage:
        used, objects = self._index.usage()
        return StorageUsage(used, objects, self.config.capacity_bytes)

    def read_object(self, key: str) -> bytes | None:
        fd = self._files.open(*object_name(key))
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            if size > self.object_bytes + MAX_KEY_BYTES:  # a planted size is never allocated
                raise ObjectCorrupt(f"object is {size} bytes, not {self.object_bytes} + key")
            return os.pread(fd, size, 0)
        finally:
            os.close(fd)

    def write_object(self, key: str, data: bytes) -> None:
        fan, name = object_name(key)
        self._files.replace(fan, name, data)
        self._index.add(name, len(data))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._writers.shutdown()
        self._dirs.close()

    # ---- one object -------------------------------------------------------------------------

    def _header_ok(self, key: str) -> bool:
        """Is a sound object stored under ``key`` (right size, every header field checked)?"""
        fan, name = object_name(key)
        header = bytearray(HEADER_BYTES)
        found = self._files.read(fan, name, header, [], None, False)
        if found is None:
            return False
        try:
            parsed = self.format.parse(memoryview(header)[: found.nread], key, self.payload_bytes)
            _check_size(found.size, self.object_bytes + parsed.key_bytes)
        except ObjectCorrupt as e:
            self._corrupt(key, e)
            self._remove(fan, name)
            return False
        return True

    def _get_one(
        self,
        index: int,
        key: str,
        views: list,
        checksums_out=None,
        go_on=None,
        headers_out=None,
        block: bool = False,
    ) -> bool:
        """Read one object into its buffers: a host block's one (``block``) or a device
        block's pieces (scattered), hashed as it is read unless the caller verifies it while
        it copies (checksums_out, headers_out: a ``ReadResult``'s,
        ``kvtier.storage.base.Verify``); ``go_on``: as for ``get_into_scattered``, called
        before the read."""
        if go_on is not None:
            go_on(f"before reading object {index} into its targets")
        fan, name = object_name(key)
        header = bytearray(HEADER_BYTES)
        encoded = key.encode()
        trailer = bytearray(len(encoded))
        views = list(views)
        verify_now = not block or checksums_out is None
        found = self._files.read(fan, name, header, views, trailer, verify_now)
        if found is None:
            return False
        try:
            parsed = self.format.parse(memoryview(header)[: found.nread], key, self.payload_bytes)
            _check_size(found.size, self.object_bytes + parsed.key_bytes)
            if found.nread != found.size:
                raise ObjectCorrupt(f"short read: {found.nread} of {found.size} bytes")
            if parsed.key_bytes and trailer != encoded:
                raise ObjectCorrupt("key trailer names another key")
            if block:
                self.format.check_or_defer(
                    header,
                    views[0],
                    key,
                    checksums_out,
                    index,
                    found.body_hash,
                    parsed,
                    headers_out=headers_out,
                )
            else:
                self.format.check(header, views, key, self.payload_bytes, found.body_hash, parsed)
        except ObjectCorrupt as e:
            self._corrupt(key, e)
            self._remove(fan, name)
            if not block:
                zero(views)
            return False
        age_s = time.time() - found.mtime_ns / 1e9
        if self.config.capacity_bytes and age_s > RECENCY_GRANULARITY_S:
            self._dirs.touch(fan, name)  # LRU recency, seen by every process sharing it
        self._index.touch(name)
        return True

    def _put_one(self, index: int, key: str, views, checksums=None) -> bool:
        """Store one object from its buffers (a host block's one, or a device block's
        pieces)."""
        if self._header_ok(key):
            return True  # immutable: the stored object stays (a corrupt one is replaced)
        fan, name = object_name(key)
        views = list(views)
        known = checksums[index] if checksums is not None else None
        header = self.format.header(key, views, known, trailer=True)
        buffers = [header, *views, key.encode()]
        try:
            try:
                self._files.publish(fan, name, buffers)
            except FileNotFoundError:  # a kept directory removed (the store deleted): again
                self._files.publish(fan, name, buffers)
        except (OSError, StorageError) as e:
            self._warn_once("write", e)
            return False
        self._index.add(name, self.object_bytes + len(key.encode()))
        return True

    # ---- index and eviction -----------------------------------------------------------------

    def _evict_if_needed(self) -> None:
        capacity = self.config.capacity_bytes
        if capacity is None or not self._index.over(capacity):
            return
        if self._index.stale():
            self._rescan()  # learn about other processes' objects and accesses
        victims = self._index.victims(capacity)
        named = self._removal_listener is not None
        keys = [self._files.key_of(n, self.object_bytes) if named else None for n in victims]
        self._evicted([k for k, n in zip(keys, victims) if self._remove(n[:2], n) and k])
        if victims:
            self.stats.add(evictions=len(victims))
            log.info("file store: evicted %d least-recently-used objects", len(victims))

    def _rescan(self) -> None:
        """Rebuild the LRU index from the directory (mtime order)."""
        found = []
        for i in range(FANOUT_DIRS):
            try:
                found += self._dirs.scan_fanout(fanout_name(i))
            except (OSError, StorageError):
                continue
        self._index.replace(found)

    # ---- paths and housekeeping -------------------------------------------------------------

    def _path(self, key: str) -> Path:
        """Where ``key``'s object is (for tools and tests: the store never opens it so)."""
        return self.root / "objects" / "/".join(object_name(key))

    def _remove(self, fan: str, name: str) -> bool:
        removed = self._files.remove(fan, name)
        if removed:
            self._index.forget(name)
        return removed

    def _large(self, keys: Sequence[str]) -> bool:
        """Whether a batch is spread over the I/O threads (``PARALLEL_MIN_BYTES``)."""
        return len(keys) * self.object_bytes >= PARALLEL_MIN_BYTES

    def _striped(self, fn, keys: Sequence[str], blocks: Sequence, prefix=False) -> list[bool]:
        """``fn(i, key, block)`` for every key; one task per I/O thread for large batches;
        ``prefix``: stop at the first False (see ``striped``)."""
        pool = self._pool if self._large(keys) else None
        return striped(pool, self.config.io_threads, fn, keys, blocks, prefix)


def _check_size(size: int, expected: int) -> None:
    if size != expected:
        raise ObjectCorrupt(f"object is {size} bytes, not {expected}")
