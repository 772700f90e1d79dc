"""S3Store: one object per block in an S3 bucket, in kvtier's own format.

Each object is the 64-byte header (checksum or MAC, layout fingerprint, the key's digest) and
the payload, named ``<prefix>/<key>`` (keys carry the weight version and the layout, so objects
of other models or versions never answer). Reads check the header against the key and the
payload against the checksum (or the MAC) before a block is reported True.

What the bucket holds is indexed here: listed once at open (ListObjectsV2, 1000 objects a
request) and again every ``refresh_s`` (merged: objects new to it go in as the least recently
used, the ones it knew keep their recency), kept in least-recently-used order. Lookups answer from
the index without a request; where the index runs out, the next keys are probed with HEADs in
parallel (another writer may have stored them: one round of requests per lookup, not one per
block). S3 keeps no recency of its own, so capacity is enforced here: after a put takes the
index over ``capacity_bytes``, the least recently used objects are deleted (bulk deletes) and
reported to the removal listener. After a restart the index is listed again, oldest modified
first: the objects survive, their recency restarts from when they were written, and capacity
holds from the first put (at open too, if the bucket holds more than it allows).

Puts are conditional (``If-None-Match: *``): an existing object is kept, as the contract asks,
even one another writer stored. A server that cannot be reached raises StorageUnavailable
(every request of a batch failed, the cause in the message); one request failing is a miss or
a failed put for that key, said once in the log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvtier.errors import ObjectCorrupt, StorageUnavailable
from kvtier.layout.spec import KVCacheSpec
from kvtier.storage.base import Read, ReadResult, StorageUsage
from kvtier.storage.file.index import LruIndex
from kvtier.storage.format import HEADER_BYTES
from kvtier.storage.object_store import ObjectStore
from kvtier.storage.s3.client import RequestFailed, S3Client
from kvtier.storage.s3.config import S3Config

log = logging.getLogger(__name__)

RELIST_AFTER_FAILURE_S = 1.0  # while the server is down, a listing is tried at most this often
_FAILED = object()  # a request that failed (a miss for its key; all failed: unreachable)


class S3Store(ObjectStore):
    """Objects in an S3 bucket. See the module docstring."""

    kind = "s3"
    quick_lookups = False
    exposes_registered_memory = False
    persistent = True

    def __init__(self, spec: KVCacheSpec, config: S3Config, *, mac_key: bytes | None = None):
        super().__init__(spec, mac_key)
        self.config = config
        self.capacity_bytes = config.capacity_bytes
        self._client = S3Client(config)
        self._index = LruIndex()
        self._listed_at: float | None = None  # monotonic time of the last full listing
        self._list_tried_at = 0.0
        self._list_lock = threading.Lock()
        self._list_error = ""  # why the last listing failed
        self._said: set[str] = set()
        self._pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="kvtier-s3")
        try:
            self._relist()
        except StorageUnavailable as e:
            log.warning("s3 store: %s; retried on first use", e)
        except BaseException:
            self._pool.shutdown(wait=False)
            raise

    # ---- the index ------------------------------------------------------------------------------

    def _relist(self) -> None:
        with self._list_lock:
            self._list_tried_at = time.monotonic()
            known = self._index.names()
            try:
                found = [(t, k, n) for t, k, n in self._client.list() if n == self.object_bytes]
            except StorageUnavailable as e:
                self._list_error = str(e)
                raise
            self._index.merge(found, since=known)  # keeps the recency this process saw
            self._listed_at = time.monotonic()
        self._evict()

    def _listed(self) -> None:
        """The index is loaded (raises StorageUnavailable while the server cannot be listed);
        a stale one is listed again in the background."""
        if self._listed_at is None:
            if time.monotonic() - self._list_tried_at < RELIST_AFTER_FAILURE_S:
                raise StorageUnavailable(self._list_error)
            self._relist()
        elif time.monotonic() - self._listed_at > self.config.refresh_s:
            self._listed_at = time.monotonic()  # one refresh at a time
            self._pool.submit(self._refresh)

    def _refresh(self) -> None:
        try:
            self._relist()
        except Exception as e:  # noqa: BLE001 - the next lookup tries again
            self._say("list", f"listing the bucket failed: {e}")

    def _known(self, key: str) -> bool:
        return self._index.contains(key)

    def holds(self, key: str) -> bool:
        """From the index alone (no request)."""
        return self._known(key)

    # ---- the contract -------------------------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        self._listed()
        n = 0
        while n < len(keys) and self._known(keys[n]):
            n += 1
        while n < len(keys):  # past the index: another writer's objects, probed in parallel
            batch = keys[n : n + self.config.concurrency]
            sizes = self._run(self._client.head, batch)
            for key, size in zip(batch, sizes):
                if size is None or size is _FAILED or size != self.object_bytes:
                    return n
                self._index.add(key, size)
                n += 1
        return n

    def _read(self, request: Read, result: ReadResult) -> None:
        keys, host_blocks = request.keys, request.host_blocks
        checksums_out, headers_out = result.checksums, result.headers
        self._listed()

        def one(i: int) -> bool | object:
            key = keys[i]
            try:
                data = self._client.get(key)
            except RequestFailed as e:
                self._say("get", f"a get failed: {e}")
                return _FAILED
            if data is None:
                self._index.forget(key)
                return False
            try:
                if len(data) != self.object_bytes:
                    raise ObjectCorrupt(f"object is {len(data)} bytes, not {self.object_bytes}")
                header, payload = data[:HEADER_BYTES], data[HEADER_BYTES:]
                self.format.check_or_defer(
                    header, payload, key, checksums_out, i, headers_out=headers_out
                )
            except ObjectCorrupt as e:
                self._corrupt(key, e)
                self.delete([key])
                return False
            host_blocks[i].numpy()[:] = np.frombuffer(payload, dtype=np.uint8)
            self._index.touch(key)
            return True

        result.found[:] = self._answers(self._run(one, range(len(keys))), "read")

    def put_from(self, keys, host_blocks, checksums=None, originals=None) -> list[bool]:
        self._check_batch(keys, host_blocks, checksums)
        if originals is not None:
            self._check_scattered(keys, originals)
        self._listed()

        def one(i: int) -> bool | object:
            key = keys[i]
            if self._known(key):
                self._index.touch(key)
                return True  # immutable: the stored object stays
            if originals is not None:  # the same bytes where no peer can write them
                payload: list = [bytes(v) for v in originals[i]]
            else:
                payload = [host_blocks[i].numpy()]
            known = checksums[i] if checksums is not None and originals is None else None
            header = self.format.header(key, payload, known)
            try:
                self._client.put(key, [header, *payload])  # False: another writer's is kept
            except RequestFailed as e:
                self._say("put", f"a put failed: {e}")
                return _FAILED
            return True

        results = self._answers(self._run(one, range(len(keys))), "write")
        for key, ok in zip(keys, results):  # recency in key order, whatever finished first
            if ok:
                self._index.add(key, self.object_bytes)
        self._evict()
        return self._count_puts(results)

    def _evict(self) -> None:
        if self.capacity_bytes is None or not self._index.over(self.capacity_bytes):
            return
        victims = self._index.victims(self.capacity_bytes)
        try:
            self._client.delete(victims)
        except RequestFailed as e:
            self._say("evict", f"deleting evicted objects failed: {e}")  # listed again later
        self.stats.add(evictions=len(victims))
        self._evicted(victims)

    def delete(self, keys: Sequence[str]) -> int:
        removed = sum(self._known(k) for k in keys)
        for key in keys:
            self._index.forget(key)
        try:
            self._client.delete(list(keys))
        except RequestFailed as e:
            raise StorageUnavailable(f"the S3 server at {self.config.endpoint}: {e}") from None
        return removed

    def usage(self) -> StorageUsage:
        used, objects = self._index.usage()
        return StorageUsage(used, objects, self.capacity_bytes)

    def read_object(self, key: str) -> bytes | None:
        data = self._client.get(key)
        return None if data is None else bytes(data)

    def write_object(self, key: str, data: bytes) -> None:
        self._client.put(key, [bytes(data)], create=False)
        self._index.add(key, len(data))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ---- helpers --------------------------------------------------------------------------------

    def _run(self, fn, items) -> list:
        """``fn`` over ``items`` on the request threads (inline for one), answers in order."""
        items = list(items)
        if len(items) == 1:
            return [_guard(fn, items[0])]
        return list(self._pool.map(lambda item: _guard(fn, item), items))

    def _answers(self, results: list, what: str) -> list[bool]:
        """Failed requests are False; all failed: the server is unreachable."""
        if results and all(r is _FAILED for r in results):
            raise StorageUnavailable(
                f"the S3 server at {self.config.endpoint} failed every {what} of the batch "
                f"({len(results)} objects; the log names the cause)"
            )
        return [r is True for r in results]

    def _say(self, what: str, message: str) -> None:
        """Log a kind of failure once (it may repeat for every block of every batch)."""
        if what not in self._said:
            self._said.add(what)
            log.warning("s3 store %s/%s: %s", self.config.bucket, self.config.prefix, message)


def _guard(fn, item):
    try:
        return fn(item)
    except RequestFailed:
        return _FAILED
