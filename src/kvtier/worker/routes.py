"""The two byte routes between device blocks and storage, chosen once per data path.

- ``StagedRoute``: through the host pool's private staging ranges — a save copies device
  blocks into the save staging (hashing while it copies) and puts them; a load gets objects into
  the load staging and verifies each inside the host->device copy, so a block that fails never
  reaches the device. Any device (CPU, CUDA), any backend.
  A load makes no existence pass: ``read`` answers a missing object as not loaded, and the
  scheduler looked the blocks up just before (the pass cost one more round trip to the store
  per load: 0.2–8 ms to a Mooncake master beside a busy engine).
- ``DirectRoute``: a CPU cache with a backend that reads scattered (file, memory: its
  ``scattered()``, a ``ScatteredIO``): objects are written from and read straight into the
  device blocks' pieces (one copy instead of two) and verified there; a block that fails is
  zeroed. No existence pass before a load: scattered reads stop at the first object that is
  missing or fails (``ScatteredIO.get_into_scattered``).
  A tier chain whose top tier reads scattered over one that does not (memory over Mooncake:
  ``covers_all`` False) takes this route too, with a ``StagedRoute`` below it: a load reads the
  blocks the scattered tiers hold straight into the device, and where such a read stops, the
  rest through the staging (from Mooncake, promoted into memory on the way) — inside the one
  route's ``fetch``. Before, such a chain took the staged route for everything: a memory hit
  was two copies, 1.2 ms more per 14 MiB load in ``vllm serve``.

A save returns the leading run of blocks stored; a load (``fetch``, a whole task) a ``Fetched``:
how many objects were fetched, which of them are verified in their device blocks, and the
``StorageUnavailable`` that stopped it, if one did (what came before it stands).

Staging a peer can write. With Mooncake in the storage the staging ranges are registered, and
Mooncake's transfer engine lets any peer of the cluster write registered memory. A check made
on the staging then proves nothing about the bytes the next copy reads from it (before, a load
checked the MAC there and the copy trusted the XXH3 it carried: no MAC). So such a route checks
nothing in the staging: the store checks the header (a ``Read`` with ``Verify.ALL_BY_CALLER``) and
each payload is copied out first, into private host blocks of the route (``PrivateBlocks``),
and checked there, MAC included (each block copied, then checked while it is in cache),
before the blocks that passed move on into the device in one copy; a chain promotes the
blocks it loaded from below only after that check (its ``promoter()``, a ``Promotes``).
Saves are copied from the device into private blocks (hashed on the way), from there into
the staging, and the store makes the checksum and MAC over the private copy
(``put_from(..., originals=...)``).
Checking in the CPU cache's own blocks instead (no extra copy) measured slower: a MAC over a
block's 56 scattered pieces there took 0.65 ms per 1.8 MiB block against 0.3–0.35 ms over one
contiguous private block (14-block loads from Mooncake: 13.7 ms against 10.7; 9.0 before any
of this, checking in the staging).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvtier.errors import ObjectCorrupt, StorageUnavailable
from kvtier.memory.copier import BlockCopier, make_copier
from kvtier.memory.device import DeviceCache
from kvtier.memory.host import HostPool, copy_block
from kvtier.storage.base import GoOn, Read, ScatteredIO, StorageBackend, Verify

# ``GoOn``: called with where a task stands before device blocks are touched; raises
# DeadlinePassed once its client may have given up (``kvtier.worker.deadline``).


@dataclass
class Fetched:
    """What a load's ``fetch`` did: ``fetched`` objects arrived; ``good[j]``: object j is
    verified in its device block (one entry per fetched object); ``error``: the outage that
    stopped it (None: it ran until a miss, a failed check or the end)."""

    fetched: int
    good: np.ndarray
    error: StorageUnavailable | None = None

    @property
    def verified(self) -> int:
        return leading_true(self.good.tolist())

    def then(self, more: Fetched) -> Fetched:
        """This, followed by ``more`` (the next objects of the same load)."""
        good = np.concatenate([self.good, more.good])
        return Fetched(self.fetched + more.fetched, good, more.error)


class StagedRoute:
    name = "staged"

    def __init__(
        self,
        copier: BlockCopier,
        host_pool: HostPool,
        storage: StorageBackend,
        staging: tuple[np.ndarray, np.ndarray],
        locks: tuple[threading.Lock, threading.Lock],
        private: tuple[PrivateBlocks, PrivateBlocks] | None = None,
    ) -> None:
        """``private`` (save, load): where saves are hashed and MACed and loads checked on
        their way, when peers can write the staging and objects are authenticated
        (``guards_staging``); None: the staging is checked and MACed in place."""
        self.copier, self.host_pool, self.storage = copier, host_pool, storage
        self.save_staging, self.load_staging = staging
        self.save_lock, self.load_lock = locks
        self.peers_write_staging = private is not None  # and checks there would count
        self.private_save: PrivateBlocks | None = None
        self.private: PrivateBlocks | None = None
        if private is not None:
            self.private_save, self.private = private

    def put(self, storage_keys: list[str], dev: np.ndarray, go_on: GoOn) -> tuple[int, int]:
        """Store the objects of ``dev``'s blocks; (leading blocks stored, bytes written)."""
        staging, done, moved = self.save_staging, 0, 0
        while done < len(storage_keys):
            chunk = slice(done, min(len(storage_keys), done + staging.size))
            ids = staging[: chunk.stop - chunk.start]
            with self.save_lock:
                go_on("before reading a chunk of its device blocks")
                blocks = [self.host_pool.block(int(i)) for i in ids]
                sums, originals = self._stage(dev[chunk], ids, blocks)
                ok = self.storage.put_from(storage_keys[chunk], blocks, sums, originals)
            stored = leading_true(ok)
            done += stored
            moved += sum(ok) * self.host_pool.block_bytes
            if stored < len(ok):
                break
        return done, moved

    def _stage(self, dev: np.ndarray, ids: np.ndarray, blocks) -> tuple[list, list | None]:
        """Copy ``dev``'s blocks into the save staging blocks ``ids`` (hashed on the way); their
        checksums and, where the staging is not trusted, the originals the store makes the
        checksum and MAC over: the private blocks the copy went through."""
        if self.private_save is None:
            self.copier.swap_out(dev, ids, checksum=True, checked=True)
            return self.host_pool.known_checksums(ids), None
        sums, originals = self.private_save.take_from_device(dev)
        for j, block in enumerate(blocks):
            copy_block(block, self.private_save.pool.block(j))
        return sums, originals

    def fetch(self, storage_keys: list[str], dev: np.ndarray, go_on: GoOn) -> Fetched:
        """A staging's worth at a time, until a chunk comes back short or with a block that
        failed its check."""
        done, goods, error = 0, [np.zeros(0, dtype=bool)], None
        step = self.load_staging.size
        while done < len(storage_keys):
            chunk = slice(done, min(len(storage_keys), done + step))
            try:
                fetched, good = self._fetch_chunk(storage_keys[chunk], dev[chunk], go_on)
            except StorageUnavailable as e:
                error = e
                break
            done += fetched
            goods.append(good)
            if fetched < chunk.stop - chunk.start or not good.all():
                break
        return Fetched(done, np.concatenate(goods), error)  # joined once, not per chunk

    def _fetch_chunk(
        self, storage_keys: list[str], dev: np.ndarray, go_on: GoOn
    ) -> tuple[int, np.ndarray]:
        """Into the load staging, then verified inside the host->device copy (or, where the
        staging is not trusted, in private blocks first). Returns (objects fetched, per
        fetched block: copied to the device)."""
        ids = self.load_staging[: dev.size]
        blocks = [self.host_pool.block(int(i)) for i in ids]
        with self.load_lock:
            if self.peers_write_staging:
                return self._fetch_unchecked(storage_keys, dev, blocks, go_on)
            got = self.storage.read(Read(storage_keys, blocks, Verify.CHECKSUM_BY_CALLER))
            fetched = got.leading
            assert got.checksums is not None
            self.host_pool.set_checksums(ids[:fetched], got.checksums[:fetched])
            go_on("after its transfer from the store, before the copy into its device blocks")
            return fetched, self.copier.swap_in_verified(ids[:fetched], dev[:fetched], checked=True)

    def _fetch_unchecked(
        self, storage_keys: list[str], dev: np.ndarray, blocks: list, go_on: GoOn
    ) -> tuple[int, np.ndarray]:
        """``fetch`` where peers can write the staging (``blocks``): checked only once copied
        out of it."""
        got = self.storage.read(Read(storage_keys, blocks, Verify.ALL_BY_CALLER))
        fetched = got.leading
        go_on("after its transfer from the store, before the copy into its device blocks")
        keys, dev = storage_keys[:fetched], dev[:fetched]
        assert self.private is not None
        pieces = self.private.pieces(fetched)
        good = check_copies(self.storage, keys, got.headers, pieces, self.private.taker(blocks))
        self.private.swap_in(good, dev)
        promoter = self.storage.promoter()
        if promoter is not None:
            verified = leading_true(good)
            promoter.promote(keys[:verified], pieces[:verified])
        return fetched, good


class DirectRoute:
    name = "direct"

    def __init__(
        self,
        copier: BlockCopier,
        io: ScatteredIO,
        payload_bytes: int,
        below: StagedRoute | None = None,
    ) -> None:
        """``below``: where a load goes on when the scattered read stops short at an object
        only a read through host blocks reaches (``io.covers_all`` False: a tier chain whose
        lower tiers read into host blocks only); None: a short read ends the load."""
        self.copier, self.io, self.payload_bytes, self.below = copier, io, payload_bytes, below

    def put(self, storage_keys: list[str], dev: np.ndarray, go_on: GoOn) -> tuple[int, int]:
        """Each object written straight from the device block's pieces (hashed there)."""
        go_on("before reading its device blocks")
        ok = self.io.put_from_scattered(
            storage_keys, self.copier.device_pieces(dev, writable=False, checked=True)
        )
        return leading_true(ok), sum(ok) * self.payload_bytes

    def fetch(self, storage_keys: list[str], dev: np.ndarray, go_on: GoOn) -> Fetched:
        """Straight into the device blocks' pieces, verified by the backend right after it
        reads each one (a block that fails is zeroed there, counted corrupt and removed);
        where that stops short and ``below`` is set, the rest through it."""
        go_on("before reading into its device blocks")
        pieces = self.copier.device_pieces(dev, checked=True)
        try:
            run = leading_true(self.io.get_into_scattered(storage_keys, pieces, go_on))
        except StorageUnavailable as e:
            return Fetched(0, np.zeros(0, dtype=bool), e)
        done = Fetched(run, np.ones(run, dtype=bool))
        if run == len(storage_keys) or self.below is None:
            return done
        return done.then(self.below.fetch(storage_keys[run:], dev[run:], go_on))


def guards_staging(storage: StorageBackend) -> bool:
    """Whether a route keeps its checks out of the staging: where peers can write it and
    objects are authenticated. (Without a MAC key any client of the store can put a forged
    object under a key it can predict: a peer writing the staging gains nothing more, and the
    checksums there only catch accidents, which they do in place.)"""
    return storage.exposes_registered_memory and storage.format.authenticated


class PrivateBlocks:
    """Host blocks of the worker's own that no peer of the store can write (never registered):
    a load from a staging a peer can write is copied here and checked before it moves on into
    the device; a save is copied here from the device, and its checksum and MAC made here.
    As many blocks as a staging range."""

    def __init__(self, device_cache: DeviceCache, staging: HostPool, num_blocks: int) -> None:
        self.pool = HostPool(staging.spec, num_blocks, pin=staging.pinned)
        self.copier = make_copier(device_cache, self.pool)

    def pieces(self, n: int) -> list[list[memoryview]]:
        """The payloads of the first ``n`` blocks, one piece each."""
        return [[self.pool.block(j).numpy().data] for j in range(n)]

    def taker(self, blocks) -> Callable[[int], object]:
        """Copies ``blocks[j]`` (a host block tensor) into block j, when called with j."""
        return lambda j: copy_block(self.pool.block(j), blocks[j])

    def take_from_device(self, dev: np.ndarray) -> tuple[list, list[list[memoryview]]]:
        """Copy device blocks ``dev`` in (hashed on the way): their checksums and payloads."""
        ids = np.arange(dev.size)
        self.copier.swap_out(dev, ids, checksum=True, checked=True)
        return self.pool.known_checksums(ids), self.pieces(dev.size)

    def swap_in(self, good: np.ndarray, dev: np.ndarray) -> None:
        """The blocks that passed their check into the device blocks ``dev`` (pairwise)."""
        if good.any():
            self.copier.swap_in(np.flatnonzero(good), dev[good], checked=True)

    def close(self) -> None:
        self.copier.close()
        self.pool.close()


def check_copies(
    storage: StorageBackend, keys, headers, pieces, land=None, scrub=None
) -> np.ndarray:
    """Check each copied payload against the header its ``read`` left (the MAC where
    objects are authenticated); which passed. ``land(j)``: copies payload j where ``pieces[j]``
    lies, just before its check. A payload that fails is ``scrub``bed (zeroed where it lies in
    a device block: bytes that failed never stay there); the caller reports the first one."""
    good = np.zeros(len(keys), dtype=bool)
    for j, key in enumerate(keys):
        if land is not None:
            land(j)
        try:
            storage.format.check_deferred(headers[j], key, pieces[j])
            good[j] = True
        except ObjectCorrupt:
            if scrub is not None:
                scrub(pieces[j])
    return good


def leading_true(flags) -> int:
    n = 0
    for flag in flags:
        if not flag:
            break
        n += 1
    return n
