"""kvtier's storage as an LMCache L2 adapter (LMCache's multi-process mode, ``plugin`` type).

LMCache loads it by configuration only::

    {"type": "plugin", "module_path": "kvtier.lmcache", "class_name": "KvtierL2Adapter",
     "adapter_params": {"storage": {"backend": "file", "root": "/data/kv"},
                        "model_dir": "/models/llama"}}

``adapter_params`` are ``kvtier.hosted.settings`` plus ``workers`` (threads running tasks,
default 4) and ``object_bytes`` (object sizes to look up before one is stored or loaded in this
process: set it to find what a previous process stored). Keys: the chunk hash with its object
group, cache salt and model name folded in, the weight version, the layout (the object's size)
and ``kv_rank`` folded in too. Every load is checked (checksum or MAC, layout, key): a bad
object is a miss, never bytes.

The interface (``lmcache.v1.distributed.l2_adapters.base``): tasks are submitted and polled;
each kind signals its own event fd when one finishes. Lookups run on this adapter's threads;
loads and stores are handed straight to a store that moves bytes on threads of its own (the
file store: ``StartsTransfers``), whose last thread answers, and run on this adapter's threads
otherwise (and for objects of several sizes, or of a size not seen yet). A lookup's
bitmap is the leading run of stored keys (what a load can use). Locks are counted per key and
released by ``submit_unlock``; kvtier's tiers do not pin objects, so one evicted between a
lookup and its load is a miss in that load (the interface allows it). Bytes are accounted per
``cache_salt`` as objects are stored, and as kvtier's tiers evict them.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.platform import create_event_notifier

from kvtier.errors import KvtierError
from kvtier.hosted.shelf import Shelf, bytes_spec, fold_hash
from kvtier.lmcache.parts import (
    KvtierL2AdapterConfig,
    L1View,
    StoredObjects,
    TaskThreads,
    bitmap_of,
    by_size,
    key_context,
    object_block,
    object_buffers,
)

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.internal_api import L1MemoryDesc
    from lmcache.v1.memory_management import MemoryObj

log = logging.getLogger(__name__)

LAYOUT = "lmcache-l2"  # in the fingerprint: LMCache's objects are opaque bytes to kvtier
# LMCache keys whose storage key is kept per object size and weight version (a dict lookup
# instead of a SHA-256 and a key string per key and task: 32 keys, ~60 us of a 3 ms load):
# ~300 bytes each, emptied when full.
MAX_KNOWN_KEYS = 1 << 16


class KvtierL2Adapter(L2AdapterInterface):
    """An L2 adapter over kvtier's storage (module docstring)."""

    def __init__(
        self,
        config: KvtierL2AdapterConfig | dict,
        l1_memory_desc: L1MemoryDesc | None = None,
        **_: Any,
    ) -> None:
        # LMCache passes a config built by ``KvtierL2AdapterConfig.from_dict`` (found by name),
        # or the raw dict when a caller builds the adapter itself.
        if not isinstance(config, KvtierL2AdapterConfig):
            config = KvtierL2AdapterConfig.from_dict(config)
        super().__init__(max_capacity_bytes=0)  # kvtier's tiers bound and evict themselves
        self._config = config
        self._shelves: dict[int, Shelf] = {}
        self._shelves_lock = threading.Lock()
        self._ids = itertools.count()
        self._lock = threading.Lock()  # results, locks, accounting below
        self._stores_done: dict[L2TaskId, L2StoreResult] = {}
        self._lookups_done: dict[L2TaskId, Bitmap] = {}
        self._loads_done: dict[L2TaskId, Bitmap] = {}
        self._locked: Counter[ObjectKey] = Counter()
        self._objects = StoredObjects()
        self._known_keys: dict[int, tuple[str, dict[ObjectKey, str]]] = {}  # by object size
        self._store_efd = create_event_notifier()
        self._lookup_efd = create_event_notifier()
        self._load_efd = create_event_notifier()
        self._l1 = L1View(l1_memory_desc) if l1_memory_desc is not None else None
        self._pool = TaskThreads(config.workers, "kvtier-l2")
        self._closed = False
        for size in config.object_bytes:
            self._shelf(size)

    # ---- event fds ---------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._store_efd.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_efd.fileno()

    def get_load_event_fd(self) -> int:
        return self._load_efd.fileno()

    # ---- tasks -------------------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        shelf = self._shelves.get(objects[0].get_size()) if objects else None
        if shelf is None or not shelf.starts_transfers:
            return self._submit(self._store, keys, objects)
        return self._submit(self._start_store, keys, objects, shelf, here=True)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores_done = self._stores_done, {}
        return done

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        return self._submit(self._lookup, keys, None)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._lookups_done.pop(task_id, None)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        with self._lock:
            for key in keys:
                if self._locked[key] <= 1:
                    self._locked.pop(key, None)
                else:
                    self._locked[key] -= 1

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        shelf = self._shelves.get(objects[0].get_size()) if objects else None
        if shelf is None or not shelf.starts_transfers:
            return self._submit(self._load, keys, objects)
        return self._submit(self._start_load, keys, objects, shelf, here=True)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        with self._lock:
            return self._loads_done.pop(task_id, None)

    def locked_keys(self) -> int:
        """How many keys are locked now (for tests and ``report_status``)."""
        with self._lock:
            return len(self._locked)

    # ---- status and lifecycle ----------------------------------------------------------------

    def report_status(self) -> dict:
        with self._shelves_lock:
            shelves = dict(self._shelves)
        healthy = not self._closed
        status: dict[str, Any] = {"is_healthy": healthy, "type": "KvtierL2Adapter"}
        try:
            status["objects"] = {size: shelf.stats() for size, shelf in shelves.items()}
        except KvtierError as e:
            status.update(is_healthy=False, error=str(e))
        status["locked_keys"] = self.locked_keys()
        return status

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown()
        with self._shelves_lock:
            shelves, self._shelves = list(self._shelves.values()), {}
        for shelf in shelves:
            shelf.close()
        for efd in (self._store_efd, self._lookup_efd, self._load_efd):
            efd.close()

    # ---- running tasks -----------------------------------------------------------------------

    def _submit(
        self,
        run: Callable[..., None],
        keys: list[ObjectKey],
        objects: list[MemoryObj] | None,
        *args: Any,
        here: bool = False,
    ) -> L2TaskId:
        """Run ``run(task_id, keys, objects, *args)`` on this adapter's threads, or on the
        caller's (``here``: it only hands the task on)."""
        if self._closed:
            raise RuntimeError("KvtierL2Adapter is closed")
        if objects is not None and len(objects) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(objects)} objects")
        task_id = next(self._ids)
        if here:
            run(task_id, keys, objects, *args)
        else:
            self._pool.submit(run, task_id, keys, objects, *args)
        return task_id

    def _shelf(self, size: int) -> Shelf:
        with self._shelves_lock:
            shelf = self._shelves.get(size)
            if shelf is None:
                shelf = Shelf(self._config.settings, bytes_spec(size, LAYOUT)).open()
                shelf.backend.watch_removals(self._objects.evicted)
                self._shelves[size] = shelf
            return shelf

    def _storage_keys(self, shelf: Shelf, keys: Sequence[ObjectKey]) -> list[str]:
        version = shelf.version  # once: a version change mid-task cannot split it
        known_at = self._known_keys.get(shelf.object_bytes)
        if known_at is None or known_at[0] != version or len(known_at[1]) > MAX_KNOWN_KEYS:
            known_at = self._known_keys[shelf.object_bytes] = (version, {})
        known = known_at[1]
        out = [known.get(key) for key in keys]
        if None in out:
            new = [i for i, k in enumerate(out) if k is None]
            hashes = [fold_hash(keys[i].chunk_hash, key_context(keys[i])) for i in new]
            for i, storage_key in zip(new, shelf.keys(hashes, version=version), strict=True):
                out[i] = known[keys[i]] = storage_key
        return out  # type: ignore[return-value]

    def _store(self, task_id: L2TaskId, keys: list[ObjectKey], objects: Any) -> None:
        ok, written = True, 0
        try:
            for size, where in by_size(objects).items():
                shelf = self._shelf(size)
                subset = [keys[i] for i in where]
                storage_keys, fresh = self._fresh(shelf, subset)
                blocks = [self._block(objects[where[j]]) for j in fresh]
                stored = shelf.put([storage_keys[j] for j in fresh], blocks)
                ok = ok and all(stored)
                written += self._stored_now(size, storage_keys, subset, fresh, stored)
        except Exception as e:  # answered as a failed store; the cause is logged
            log.warning("kvtier L2 store task %d failed: %s", task_id, e)
            ok = False
        self._finish(self._stores_done, task_id, L2StoreResult(ok, written), self._store_efd)

    def _start_store(self, task_id: L2TaskId, keys: list, objects: Any, shelf: Shelf) -> None:
        """A store handed straight to a store that writes on its own threads
        (``Shelf.start_put``), as ``_start_load``."""
        buffers = object_buffers(objects, shelf.object_bytes, self._l1)
        if buffers is None:
            self._pool.submit(self._store, task_id, keys, objects)
            return

        def done(stored: list[bool] | None, error: BaseException | None) -> None:
            ok, written = False, 0
            try:
                if error is not None:
                    raise error
                assert stored is not None
                ok = all(stored)
                written = self._stored_now(shelf.object_bytes, storage_keys, keys, fresh, stored)
            except Exception as e:  # answered as a failed store; the cause is logged
                log.warning("kvtier L2 store task %d failed: %s", task_id, e)
            result = L2StoreResult(ok, written)
            self._finish(self._stores_done, task_id, result, self._store_efd)

        try:
            storage_keys, fresh = self._fresh(shelf, keys)
            shelf.start_put([storage_keys[j] for j in fresh], [buffers[j] for j in fresh], done)
        except Exception as e:  # answered here
            done(None, e)

    def _fresh(self, shelf: Shelf, keys: Sequence[ObjectKey]) -> tuple[list[str], list[int]]:
        """The storage keys of ``keys``, and which of them to write: what this adapter stored
        is not written again (nor counted twice); anything else is put, which keeps an object
        already stored (kvtier's put contract)."""
        storage_keys = self._storage_keys(shelf, keys)
        return storage_keys, self._objects.fresh(storage_keys)

    def _stored_now(
        self, size: int, storage_keys: list[str], keys: Sequence, fresh: list[int], stored: list
    ) -> int:
        """Account what a put stored (of ``fresh``); the bytes it wrote."""
        new = [j for j, good in zip(fresh, stored, strict=True) if good]
        if new:
            self._objects.add([storage_keys[j] for j in new], [keys[j] for j in new], size)
            self._notify_keys_stored([keys[j] for j in new], [size] * len(new))
        return size * len(new)

    def _lookup(self, task_id: L2TaskId, keys: list[ObjectKey], _: Any) -> None:
        bitmap = Bitmap(len(keys))
        found = 0
        try:
            with self._shelves_lock:
                shelves = list(self._shelves.values())
            for shelf in shelves:
                found = max(found, shelf.lookup_prefix(self._storage_keys(shelf, keys)))
        except Exception as e:  # answered as misses
            log.warning("kvtier L2 lookup task %d failed: %s", task_id, e)
        if found:
            bitmap.set_range(0, found)
            with self._lock:
                self._locked.update(keys[:found])
        self._finish(self._lookups_done, task_id, bitmap, self._lookup_efd)

    def _load(self, task_id: L2TaskId, keys: list[ObjectKey], objects: Any) -> None:
        self._finish_load(task_id, keys, self._read(task_id, keys, objects))

    def _start_load(self, task_id: L2TaskId, keys: list, objects: Any, shelf: Shelf) -> None:
        """A load handed straight to a store that reads on its own threads (``Shelf.start_get``)
        and answered by the one that finishes it: one hand-off fewer than through this adapter's
        threads, and byte buffers instead of tensors (32 x 256 KiB from the file store: ~0.35
        ms of a 3 ms load). Objects of another size than the first go through ``_load``."""
        buffers = object_buffers(objects, shelf.object_bytes, self._l1)
        if buffers is None:
            self._pool.submit(self._load, task_id, keys, objects)
            return

        def done(found: list[bool] | None, error: BaseException | None) -> None:
            if error is not None:
                log.warning("kvtier L2 load task %d failed: %s", task_id, error)
            hits = [i for i, hit in enumerate(found or ()) if hit]
            self._finish_load(task_id, keys, hits)

        try:
            shelf.start_get(self._storage_keys(shelf, keys), buffers, done)
        except Exception as e:  # answered as misses, here
            done(None, e)

    def _read(self, task_id: L2TaskId, keys: list, objects: Any) -> list[int]:
        """Read each object; the indices that now hold their key's bytes."""
        found: list[int] = []
        try:
            groups = by_size(objects)
            for size, index in groups.items():
                shelf = self._shelf(size)
                if len(groups) == 1:  # almost always: one size, every object in order
                    subset, blocks = keys, [self._block(obj) for obj in objects]
                else:
                    subset = [keys[i] for i in index]
                    blocks = [self._block(objects[i]) for i in index]
                good = shelf.get(self._storage_keys(shelf, subset), blocks)
                found += [i for i, hit in zip(index, good, strict=True) if hit]
        except Exception as e:  # answered as misses
            log.warning("kvtier L2 load task %d failed: %s", task_id, e)
        return found

    def _finish_load(self, task_id: L2TaskId, keys: list[ObjectKey], found: list[int]) -> None:
        self._finish(self._loads_done, task_id, bitmap_of(len(keys), found), self._load_efd)
        if found:  # LRU bookkeeping of LMCache's listeners: after the answer, off its path
            self._notify_keys_accessed([keys[i] for i in found])

    def _block(self, obj: MemoryObj) -> torch.Tensor:
        return object_block(obj, self._l1)

    def _finish(self, done: dict, task_id: L2TaskId, result: Any, efd: Any) -> None:
        gone = self._objects.take_evicted()
        if gone:
            self._notify_keys_deleted([key for key, _ in gone], [size for _, size in gone])
        with self._lock:
            done[task_id] = result
        self._pool.answering()  # this thread takes the caller's next task
        efd.notify()
