"""DataPath: executes one data task on the device cache, host pool and storage of one rank.

The host pool holds ``num_host_blocks`` engine-addressed blocks followed by two private staging
ranges (save and load), so storage tasks never touch the engine's host blocks and a save and a
load can run at once. Storage tasks move at most ``staging_blocks`` blocks per step.

Results list exactly the blocks that hold correct data: a load stops at the first block that is
missing, fails, or fails its checksum (verified inside the host->device copy); a save reports
the prefix now in storage. Storage that cannot be reached costs "0 blocks", never an exception.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from kvtier.copier import BlockCopier, as_block_ids, make_copier
from kvtier.device import DeviceCache
from kvtier.errors import InvalidBlockIds, StorageUnavailable
from kvtier.host import HostPool
from kvtier.keys import HASH_BYTES, KeyScheme
from kvtier.storage.base import StorageBackend
from kvtier.tasks import Load, LoadHost, Lookup, Save, SaveHost, Status, SwapIn, SwapOut

log = logging.getLogger(__name__)


class Outcome:
    """What a handler reports; the worker wraps it into a Result."""

    __slots__ = ("status", "blocks", "count", "bytes_moved", "message")

    def __init__(
        self,
        status: Status,
        blocks: list[int] | None = None,
        count: int = 0,
        bytes_moved: int = 0,
        message: str = "",
    ) -> None:
        self.status, self.blocks, self.count = status, blocks or [], count
        self.bytes_moved, self.message = bytes_moved, message


class DataPath:
    def __init__(
        self,
        device_cache: DeviceCache,
        host_pool: HostPool,
        num_host_blocks: int,
        staging_blocks: int,
        storage: StorageBackend,
        keys: KeyScheme,
    ) -> None:
        self.device_cache = device_cache
        self.host_pool = host_pool
        self.num_host_blocks = num_host_blocks
        self.storage = storage
        self.keys = keys
        self.copier: BlockCopier = make_copier(device_cache, host_pool)
        first = num_host_blocks
        self._staging = {
            "save": np.arange(first, first + staging_blocks, dtype=np.int64),
            "load": np.arange(first + staging_blocks, first + 2 * staging_blocks, dtype=np.int64),
        }
        self._keys_lock = threading.Lock()
        storage.register_host_pool(host_pool)

    # ---- keys -------------------------------------------------------------------------------

    def set_version(self, version: str) -> None:
        with self._keys_lock:
            self.keys = self.keys.with_version(version)

    def _storage_keys(self, hashes: list[bytes]) -> list[str]:
        for i, h in enumerate(hashes):
            if len(h) != HASH_BYTES:
                raise InvalidBlockIds(f"block hash {i} has {len(h)} bytes, need {HASH_BYTES}")
        with self._keys_lock:
            return self.keys.keys(hashes)

    def _engine_host_ids(self, ids: list[int], what: str = "host_block_ids") -> np.ndarray:
        arr = as_block_ids(ids, what)
        bad = arr[(arr < 0) | (arr >= self.num_host_blocks)]
        if bad.size:
            raise InvalidBlockIds(
                f"host block id {int(bad[0])} out of range 0..{self.num_host_blocks - 1}"
            )
        return arr

    @staticmethod
    def _same_length(hashes: list[bytes], ids: list[int], what: str) -> None:
        if len(hashes) != len(ids):
            raise InvalidBlockIds(f"{len(hashes)} block hashes but {len(ids)} {what}")

    # ---- handlers ---------------------------------------------------------------------------

    def run(self, task) -> Outcome:
        handler: Callable[..., Outcome] = getattr(self, "_" + type(task).__struct_config__.tag)
        return handler(task)

    def _swap_out(self, task: SwapOut) -> Outcome:
        host = self._engine_host_ids(task.host_block_ids)
        moved = self.copier.swap_out(task.device_block_ids, host)
        return Outcome(Status.OK, list(task.device_block_ids), bytes_moved=moved)

    def _swap_in(self, task: SwapIn) -> Outcome:
        host = self._engine_host_ids(task.host_block_ids)
        moved = self.copier.swap_in(host, task.device_block_ids)
        return Outcome(Status.OK, list(task.device_block_ids), bytes_moved=moved)

    def _lookup(self, task: Lookup) -> Outcome:
        keys = self._storage_keys(task.block_hashes)
        try:
            return Outcome(Status.OK, count=self.storage.exists_prefix(keys))
        except StorageUnavailable as e:
            return Outcome(Status.ERROR, message=f"storage unavailable: {e}")

    def _save(self, task: Save) -> Outcome:
        self._same_length(task.block_hashes, task.device_block_ids, "device_block_ids")
        keys = self._storage_keys(task.block_hashes)
        dev = as_block_ids(task.device_block_ids, "device_block_ids")
        self.copier.check_device_ids(dev, destination=False)
        staging = self._staging["save"]
        try:
            done = self.storage.exists_prefix(keys)  # already stored: skipped
            moved = 0
            while done < len(keys):
                chunk = slice(done, min(len(keys), done + staging.size))
                ids = staging[: chunk.stop - chunk.start]
                self.copier.swap_out(dev[chunk], ids, checksum=True)
                blocks = [self.host_pool.block(int(i)) for i in ids]
                ok = self.storage.put_from(keys[chunk], blocks, self.host_pool.known_checksums(ids))
                stored = _leading_true(ok)
                done += stored
                moved += stored * self.host_pool.block_bytes
                if stored < len(ok):
                    break
        except StorageUnavailable as e:
            return Outcome(Status.ERROR, message=f"storage unavailable: {e}")
        return _prefix_outcome(task.device_block_ids, done, moved, "stored")

    def _load(self, task: Load) -> Outcome:
        self._same_length(task.block_hashes, task.device_block_ids, "device_block_ids")
        keys = self._storage_keys(task.block_hashes)
        dev = as_block_ids(task.device_block_ids, "device_block_ids")
        self.copier.check_device_ids(dev, destination=True)
        staging = self._staging["load"]
        sums = np.zeros(staging.size, dtype=np.uint64)
        done = moved = 0
        try:
            available = self.storage.exists_prefix(keys)
            while done < available:
                chunk = slice(done, min(available, done + staging.size))
                ids = staging[: chunk.stop - chunk.start]
                blocks = [self.host_pool.block(int(i)) for i in ids]
                fetched = _leading_true(
                    self.storage.get_into(keys[chunk], blocks, sums[: ids.size])
                )
                self.host_pool.set_checksums(ids[:fetched], sums[:fetched])
                good = self.copier.swap_in_verified(ids[:fetched], dev[chunk][:fetched])
                verified = _leading_true(good.tolist())
                if verified < fetched:
                    self.storage.report_corrupt(
                        keys[chunk][verified], "payload checksum mismatch in the copy"
                    )
                done += verified
                moved += verified * self.host_pool.block_bytes
                if verified < ids.size:
                    break
        except StorageUnavailable as e:
            return Outcome(
                Status.ERROR,
                list(task.device_block_ids[:done]),
                bytes_moved=moved,
                message=f"storage unavailable: {e}",
            )
        return _prefix_outcome(task.device_block_ids, done, moved, "loaded")

    def _save_host(self, task: SaveHost) -> Outcome:
        self._same_length(task.block_hashes, task.host_block_ids, "host_block_ids")
        keys = self._storage_keys(task.block_hashes)
        host = self._engine_host_ids(task.host_block_ids)
        try:
            done = self.storage.exists_prefix(keys)
            rest = host[done:]
            ok = self.storage.put_from(
                keys[done:],
                [self.host_pool.block(int(i)) for i in rest],
                self.host_pool.known_checksums(rest),
            )
        except StorageUnavailable as e:
            return Outcome(Status.ERROR, message=f"storage unavailable: {e}")
        stored = _leading_true(ok)
        return _prefix_outcome(
            task.host_block_ids, done + stored, stored * self.host_pool.block_bytes, "stored"
        )

    def _load_host(self, task: LoadHost) -> Outcome:
        self._same_length(task.block_hashes, task.host_block_ids, "host_block_ids")
        keys = self._storage_keys(task.block_hashes)
        host = self._engine_host_ids(task.host_block_ids)
        try:
            available = self.storage.exists_prefix(keys)
            ids = host[:available]
            loaded = _leading_true(
                self.storage.get_into(keys[:available], [self.host_pool.block(int(i)) for i in ids])
            )
        except StorageUnavailable as e:
            return Outcome(Status.ERROR, message=f"storage unavailable: {e}")
        self.host_pool.forget_checksums(host)
        return _prefix_outcome(
            task.host_block_ids, loaded, loaded * self.host_pool.block_bytes, "loaded"
        )

    def close(self) -> None:
        self.copier.close()
        self.storage.unregister_host_pool(self.host_pool)


def _leading_true(flags) -> int:
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n


def _prefix_outcome(ids: list[int], done: int, moved: int, verb: str) -> Outcome:
    if done == len(ids):
        return Outcome(Status.OK, list(ids), bytes_moved=moved)
    return Outcome(
        Status.PARTIAL,
        list(ids[:done]),
        bytes_moved=moved,
        message=f"{verb} {done} of {len(ids)} blocks",
    )


def timed(fn: Callable[[], Outcome]) -> tuple[Outcome, float]:
    start = time.perf_counter()
    outcome = fn()
    return outcome, time.perf_counter() - start
