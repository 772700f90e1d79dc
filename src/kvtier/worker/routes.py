"""The two byte routes between device blocks and storage, chosen once per data path.

- ``StagedRoute``: through the host pool's private staging ranges — a save copies device
  blocks into the save staging (hashing while it copies) and puts them; a load gets objects into
  the load staging and verifies each inside the host->device copy, so a block that fails never
  reaches the device. Any device (CPU, CUDA), any backend.
  A load makes no existence pass: ``get_into`` answers a missing object as not loaded, and the
  scheduler looked the blocks up just before (the pass cost one more round trip to the store
  per load: 0.2–8 ms to a Mooncake master beside a busy engine).
- ``DirectRoute``: a CPU cache with a backend that reads scattered (file, memory): objects are
  written from and read straight into the device blocks' pieces (one copy instead of two) and
  verified there; a block that fails is zeroed. No existence pass before a load: scattered reads
  stop at the first object that is missing or fails (``StorageBackend.get_into_scattered``).
  A tier chain whose top tier reads scattered over one that does not (memory over Mooncake:
  ``reads_scattered_on_top``) takes this route too, with a ``StagedRoute`` for what is left: a
  load reads the blocks the scattered tiers hold straight into the device, and the rest of it
  through the staging (from Mooncake, promoted into memory on the way). Before, such a chain
  took the staged route for everything: a memory hit was two copies, 1.2 ms more per 14 MiB
  load in ``vllm serve``.

Both return the leading run of blocks that are stored (saves) or verified in place (loads).
"""

from __future__ import annotations

import threading

import numpy as np

from kvtier.memory.copier import BlockCopier
from kvtier.memory.host import HostPool
from kvtier.storage.base import GoOn, StorageBackend

# ``GoOn``: called with where a task stands before device blocks are touched; raises
# DeadlinePassed once its client may have given up (``kvtier.worker.deadline``).


class StagedRoute:
    name = "staged"
    rest = None  # a short read ends the load

    def __init__(
        self,
        copier: BlockCopier,
        host_pool: HostPool,
        storage: StorageBackend,
        staging: tuple[np.ndarray, np.ndarray],
        locks: tuple[threading.Lock, threading.Lock],
    ) -> None:
        self.copier, self.host_pool, self.storage = copier, host_pool, storage
        self.save_staging, self.load_staging = staging
        self.save_lock, self.load_lock = locks

    @property
    def load_step(self) -> int:
        return self.load_staging.size

    def put(self, storage_keys: list[str], dev: np.ndarray, go_on: GoOn) -> tuple[int, int]:
        """Store the objects of ``dev``'s blocks; (leading blocks stored, bytes written)."""
        staging, done, moved = self.save_staging, 0, 0
        while done < len(storage_keys):
            chunk = slice(done, min(len(storage_keys), done + staging.size))
            ids = staging[: chunk.stop - chunk.start]
            with self.save_lock:
                go_on("before reading a chunk of its device blocks")
                self.copier.swap_out(dev[chunk], ids, checksum=True, checked=True)
                blocks = [self.host_pool.block(int(i)) for i in ids]
                ok = self.storage.put_from(
                    storage_keys[chunk], blocks, self.host_pool.known_checksums(ids)
                )
            stored = leading_true(ok)
            done += stored
            moved += sum(ok) * self.host_pool.block_bytes
            if stored < len(ok):
                break
        return done, moved

    def fetch(
        self, storage_keys: list[str], dev: np.ndarray, go_on: GoOn
    ) -> tuple[int, np.ndarray]:
        """Into the load staging, then verified inside the host->device copy. Returns
        (objects fetched, per fetched block: copied to the device)."""
        ids = self.load_staging[: dev.size]
        sums = np.zeros(ids.size, dtype=np.uint64)
        blocks = [self.host_pool.block(int(i)) for i in ids]
        with self.load_lock:
            fetched = leading_true(self.storage.get_into(storage_keys, blocks, sums))
            self.host_pool.set_checksums(ids[:fetched], sums[:fetched])
            go_on("after its transfer from the store, before the copy into its device blocks")
            return fetched, self.copier.swap_in_verified(ids[:fetched], dev[:fetched], checked=True)


class DirectRoute:
    name = "direct"
    load_step = 1 << 16  # no staging to fill: a whole task per call

    def __init__(
        self, copier: BlockCopier, storage: StorageBackend, rest: StagedRoute | None = None
    ) -> None:
        """``rest``: where a load goes on when the scattered read stops short (a tier chain
        whose lower tiers read into host blocks only; ``DataPath`` switches to it); None: a
        short read ends the load."""
        self.copier, self.storage, self.rest = copier, storage, rest

    def put(self, storage_keys: list[str], dev: np.ndarray, go_on: GoOn) -> tuple[int, int]:
        """Each object written straight from the device block's pieces (hashed there)."""
        go_on("before reading its device blocks")
        ok = self.storage.put_from_scattered(
            storage_keys, self.copier.device_pieces(dev, writable=False, checked=True)
        )
        return leading_true(ok), sum(ok) * self.storage.payload_bytes

    def fetch(
        self, storage_keys: list[str], dev: np.ndarray, go_on: GoOn
    ) -> tuple[int, np.ndarray]:
        """Straight into the device blocks' pieces, verified by the backend right after it
        reads each one (a block that fails is zeroed there, counted corrupt and removed)."""
        go_on("before reading into its device blocks")
        pieces = self.copier.device_pieces(dev, checked=True)
        got = self.storage.get_into_scattered(storage_keys, pieces, go_on)  # and per object
        fetched = leading_true(got)
        return fetched, np.ones(fetched, dtype=bool)


def leading_true(flags) -> int:
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n
