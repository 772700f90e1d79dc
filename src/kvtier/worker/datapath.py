"""DataPath: executes one data task on the device cache, host pool and storage of one rank.

The host pool is laid out by ``HostLayout``: the engine's blocks, then two private staging ranges
(save and load), so storage tasks never touch the engine's host blocks and a save and a load can
run at once. Storage tasks move at most ``staging_blocks`` blocks per step.

Every storage task runs with the ``KeyScheme`` it was stamped with when the worker admitted it
(namespace, weight version, fingerprint, rank), so a task submitted before a weight update is
stored and read under the version that was current when it was submitted.

Results list exactly the blocks that hold correct data: a load stops at the first block that is
missing, fails, or fails its checksum. A device block beyond the reported prefix holds its old
bytes, zeros, or verified bytes of its own key — never bytes that failed a check. How bytes move
between device blocks and storage is chosen once, when the data path is built
(``kvtier.worker.routes``): through host staging, or — on a CPU cache with a backend that reads
scattered (file, memory) — straight into and out of the device blocks. A save reports the prefix
now in storage, and in ``count`` how much of it was stored already (skipped). Storage that
cannot be reached costs "0 blocks", never an exception.

Backends whose peers can read registered memory (Mooncake) get only the staging ranges
registered; host tasks (``save_host``/``load_host``) then pass through staging too, holding the
range's lock (a save and a save_host run on different threads).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from kvtier.errors import InvalidBlockIds, StorageUnavailable
from kvtier.layout.block_ids import as_block_ids, check_block_ids, check_same_length
from kvtier.layout.keys import KeyScheme
from kvtier.memory.copier import BlockCopier, make_copier
from kvtier.memory.device import DeviceCache
from kvtier.memory.host import HostLayout, HostPool, copy_block
from kvtier.storage.base import Read, StorageBackend, Verify
from kvtier.transport.tasks import (
    DataTask,
    Load,
    LoadHost,
    Lookup,
    Save,
    SaveHost,
    Status,
    SwapIn,
    SwapOut,
)
from kvtier.worker import deadline
from kvtier.worker.deadline import NO_CUTOFF
from kvtier.worker.routes import (
    DirectRoute,
    GoOn,
    PrivateBlocks,
    StagedRoute,
    check_copies,
    guards_staging,
    leading_true,
)

log = logging.getLogger(__name__)

CHECK_FAILED = "payload failed its check in the copy out of the staging (checksum or MAC)"


@dataclass(slots=True)
class Outcome:
    """What the data path reports for one task; the worker wraps it into a Result."""

    status: Status
    blocks: list[int] = field(default_factory=list)
    count: int = 0
    bytes_moved: int = 0
    message: str = ""
    tiers: bytes = b""  # a lookup's tier of each found block (Result.tiers)


class DataPath:
    def __init__(
        self,
        device_cache: DeviceCache,
        host_pool: HostPool,
        layout: HostLayout,
        storage: StorageBackend,
    ) -> None:
        if host_pool.num_blocks != layout.total_blocks:
            raise InvalidBlockIds(
                f"host pool has {host_pool.num_blocks} blocks; the layout needs "
                f"{layout.total_blocks}"
            )
        self.device_cache = device_cache
        self.host_pool = host_pool
        self.layout = layout
        self.storage = storage
        self.copier: BlockCopier = make_copier(device_cache, host_pool)
        self._save_staging = layout.save_staging
        self._load_staging = layout.load_staging
        self._save_lock = threading.Lock()  # the save staging range (save, staged save_host)
        self._load_lock = threading.Lock()  # the load staging range (load, staged load_host)
        self._staged_host_io = storage.exposes_registered_memory
        self._private: tuple[PrivateBlocks, PrivateBlocks] | None = None
        if guards_staging(storage):  # checked and MACed there (kvtier.worker.routes)
            self._private = (
                PrivateBlocks(device_cache, host_pool, layout.staging_blocks),
                PrivateBlocks(device_cache, host_pool, layout.staging_blocks),
            )
        staged = StagedRoute(
            self.copier,
            host_pool,
            storage,
            (self._save_staging, self._load_staging),
            (self._save_lock, self._load_lock),
            self._private,
        )
        self.route: StagedRoute | DirectRoute = staged
        io = storage.scattered()
        if self.copier.direct_device_access and io is not None:
            below = None if io.covers_all else staged
            self.route = DirectRoute(self.copier, io, storage.payload_bytes, below)
        if self._staged_host_io:  # chosen once too: host tasks through staging, or not
            self._put_host, self._get_host = self._put_staged, self._get_staged
        else:
            self._put_host, self._get_host = self._put_host_blocks, self._get_host_blocks
        first = layout.engine_blocks
        storage.register_host_pool(
            host_pool, range(first, layout.total_blocks) if self._staged_host_io else None
        )

    def run(self, task: DataTask, keys: KeyScheme, until: float = NO_CUTOFF) -> Outcome:
        """Execute ``task``; storage tasks use ``keys``. Raises KvtierError on bad input, and
        DeadlinePassed where a storage task would touch device blocks after ``until``
        (``kvtier.worker.deadline``)."""
        match task:
            case SwapOut():
                return self._swap_out(task)
            case SwapIn():
                return self._swap_in(task)
            case Save():
                return self._save(task, keys, partial(deadline.check, until, task))
            case Load():
                return self._load(task, keys, partial(deadline.check, until, task))
            case SaveHost():
                return self._save_host(task, keys)
            case LoadHost():
                return self._load_host(task, keys)
            case Lookup():
                return self._lookup(task, keys)
        raise InvalidBlockIds(f"not a data task: {type(task).__name__}")

    # ---- ids --------------------------------------------------------------------------------

    def _engine_host_ids(self, ids: list[int], *, destination: bool = False) -> np.ndarray:
        arr = as_block_ids(ids, "host_block_ids")
        check_block_ids(arr, self.layout.engine_blocks, "host block id", destination=destination)
        return arr

    @staticmethod
    def _same_length(hashes: list[bytes], ids: list[int], what: str) -> None:
        check_same_length(hashes, ids, "block_hashes", what)

    # ---- handlers ---------------------------------------------------------------------------

    def _swap_out(self, task: SwapOut) -> Outcome:
        limit = self.layout.engine_blocks  # the engine's share of the host pool
        moved = self.copier.swap_out(task.device_block_ids, task.host_block_ids, host_limit=limit)
        return Outcome(Status.OK, task.device_block_ids, bytes_moved=moved)

    def _swap_in(self, task: SwapIn) -> Outcome:
        limit = self.layout.engine_blocks
        moved = self.copier.swap_in(task.host_block_ids, task.device_block_ids, limit)
        return Outcome(Status.OK, task.device_block_ids, bytes_moved=moved)

    def _lookup(self, task: Lookup, keys: KeyScheme) -> Outcome:
        storage_keys = keys.keys(task.block_hashes)
        try:
            count, tiers = self.storage.prefix_tiers(storage_keys)
            return Outcome(Status.OK, count=count, tiers=tiers)
        except StorageUnavailable as e:
            return Outcome(Status.ERROR, message=f"storage unavailable: {e}")

    def _save(self, task: Save, keys: KeyScheme, go_on: GoOn) -> Outcome:
        self._same_length(task.block_hashes, task.device_block_ids, "device_block_ids")
        storage_keys = keys.keys(task.block_hashes)
        dev = as_block_ids(task.device_block_ids, "device_block_ids")
        self.copier.check_device_ids(dev, destination=False)
        try:
            skipped = self.storage.exists_prefix(storage_keys)  # already stored
            stored, moved = self.route.put(storage_keys[skipped:], dev[skipped:], go_on)
        except StorageUnavailable as e:
            return Outcome(Status.ERROR, message=f"storage unavailable: {e}")
        return _prefix_outcome(task.device_block_ids, skipped + stored, moved, "stored", skipped)

    def _load(self, task: Load, keys: KeyScheme, go_on: GoOn) -> Outcome:
        self._same_length(task.block_hashes, task.device_block_ids, "device_block_ids")
        storage_keys = keys.keys(task.block_hashes)
        dev = as_block_ids(task.device_block_ids, "device_block_ids")
        self.copier.check_device_ids(dev, destination=True)
        got = self.route.fetch(storage_keys, dev, go_on)  # stops at the first not loaded
        done = got.verified
        moved, error = int(got.good.sum()) * self.host_pool.block_bytes, got.error
        try:
            if error is None and done < got.fetched:
                self.storage.report_corrupt(storage_keys[done], CHECK_FAILED)
            if error is None:
                self._drop_unverified_after_corrupt(storage_keys, done)
        except StorageUnavailable as e:
            error = e
        if error is not None:
            return Outcome(
                Status.ERROR,
                list(task.device_block_ids[:done]),
                bytes_moved=moved,
                message=f"storage unavailable: {error}",
            )
        return _prefix_outcome(task.device_block_ids, done, moved, "loaded")

    def _drop_unverified_after_corrupt(self, storage_keys: list[str], done: int) -> None:
        """A load that stopped at a bad object removes the objects after it: they were not
        verified, and a save keeps a stored object whose header is sound — without this the
        caller's save of the recomputed blocks would leave them, and each later load would
        find the next bad one (a prefix repaired one block per run)."""
        if done < len(storage_keys) and self.storage.found_corrupt(storage_keys[done]):
            removed = self.storage.delete(storage_keys[done + 1 :])
            if removed:
                log.warning(
                    "load stopped at a corrupt object: removed the %d unverified objects after "
                    "it (they are saved again when recomputed)",
                    removed,
                )

    def _save_host(self, task: SaveHost, keys: KeyScheme) -> Outcome:
        self._same_length(task.block_hashes, task.host_block_ids, "host_block_ids")
        storage_keys = keys.keys(task.block_hashes)
        host = self._engine_host_ids(task.host_block_ids)
        try:
            done = self.storage.exists_prefix(storage_keys)
            ok = self._put_host(storage_keys[done:], host[done:])
        except StorageUnavailable as e:
            return Outcome(Status.ERROR, message=f"storage unavailable: {e}")
        stored = leading_true(ok)
        moved = sum(ok) * self.host_pool.block_bytes
        return _prefix_outcome(task.host_block_ids, done + stored, moved, "stored", done)

    def _load_host(self, task: LoadHost, keys: KeyScheme) -> Outcome:
        self._same_length(task.block_hashes, task.host_block_ids, "host_block_ids")
        storage_keys = keys.keys(task.block_hashes)
        host = self._engine_host_ids(task.host_block_ids, destination=True)
        try:
            available = self.storage.exists_prefix(storage_keys)
            ok = self._get_host(storage_keys[:available], host[:available])
            loaded = leading_true(ok)
            self._drop_unverified_after_corrupt(storage_keys, loaded)
        except StorageUnavailable as e:
            return Outcome(Status.ERROR, message=f"storage unavailable: {e}")
        self.host_pool.forget_checksums(host)
        return _prefix_outcome(
            task.host_block_ids, loaded, sum(ok) * self.host_pool.block_bytes, "loaded"
        )

    def _put_host_blocks(
        self, storage_keys: list[str], host: np.ndarray, copied_from: np.ndarray | None = None
    ) -> list[bool]:
        """Put host blocks. ``copied_from``: the engine's host blocks they are copies of (in
        the staging, which peers can write): their recorded checksums, and the originals the
        store makes checksum and MAC over."""
        blocks = [self.host_pool.block(int(i)) for i in host]
        if copied_from is None:
            return self.storage.put_from(storage_keys, blocks, self.host_pool.known_checksums(host))
        sums = self.host_pool.known_checksums(copied_from)
        originals = [[self.host_pool.block(int(i)).numpy().data] for i in copied_from]
        return self.storage.put_from(storage_keys, blocks, sums, originals)

    def _get_host_blocks(self, storage_keys: list[str], host: np.ndarray) -> list[bool]:
        return self.storage.get_into(storage_keys, [self.host_pool.block(int(i)) for i in host])

    def _put_staged(self, storage_keys: list[str], host: np.ndarray) -> list[bool]:
        """``_put_host_blocks`` through the save staging, a staging-sized chunk at a time."""
        ok: list[bool] = []
        step = self._save_staging.size
        for start in range(0, host.size, step):
            src = host[start : start + step]
            ids = self._save_staging[: src.size]
            with self._save_lock:
                for s, d in zip(src.tolist(), ids.tolist()):
                    copy_block(self.host_pool.block(d), self.host_pool.block(s))
                ok += self._put_host_blocks(storage_keys[start : start + src.size], ids, src)
            if not all(ok):
                break
        return ok

    def _get_staged(self, storage_keys: list[str], host: np.ndarray) -> list[bool]:
        """``_get_host_blocks`` through the load staging (registered: peers can write it), so
        each block is checked where it lands, in the engine's host block (a block that fails is
        zeroed there); then a chain may promote it."""
        ok: list[bool] = []
        step = self._load_staging.size
        for start in range(0, host.size, step):
            dst = host[start : start + step]
            ids = self._load_staging[: dst.size]
            keys = storage_keys[start : start + dst.size]
            with self._load_lock:
                blocks = [self.host_pool.block(int(i)) for i in ids]
                got = self.storage.read(Read(keys, blocks, Verify.ALL_BY_CALLER))
                fetched, headers = got.leading, got.headers
                landed = [self.host_pool.block(d) for d in dst[:fetched].tolist()]
                for block, mine in zip(blocks, landed):
                    copy_block(mine, block)
            pieces = [[b.numpy().data] for b in landed]
            good = check_copies(self.storage, keys, headers, pieces, scrub=_zero).tolist()
            verified = leading_true(good)
            if verified < fetched:
                self.storage.report_corrupt(keys[verified], CHECK_FAILED)
            if (promoter := self.storage.promoter()) is not None:
                promoter.promote(keys[:verified], pieces[:verified])
            ok += good + [False] * (len(keys) - fetched)
            if not all(ok):
                break
        return ok

    def close(self) -> None:
        self.copier.close()
        for private in self._private or ():
            private.close()
        self.storage.unregister_host_pool(self.host_pool)


def _prefix_outcome(ids: list[int], done: int, moved: int, verb: str, skipped: int = 0) -> Outcome:
    """``ids[:done]`` hold correct data; for saves, ``skipped`` of them were already stored."""
    if done == len(ids):
        return Outcome(Status.OK, list(ids), count=skipped, bytes_moved=moved)
    return Outcome(
        Status.PARTIAL,
        list(ids[:done]),
        count=skipped,
        bytes_moved=moved,
        message=f"{verb} {done} of {len(ids)} blocks",
    )


def _zero(views) -> None:
    """Scrub bytes that failed a check (never left where the engine reads)."""
    for view in views:
        view[:] = bytes(len(view))
