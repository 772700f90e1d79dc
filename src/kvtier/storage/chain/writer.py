"""The lower tiers of a tier chain: which are up, and the one thread that writes objects down.

A chain (``kvtier.storage.chain.store``) saves into its top tier. An object there that the lower
tiers do not hold yet is *dirty*. ``LowerWriter`` writes dirty objects down, from one thread:

- ``write: through`` queues each saved key at once; ``write: back`` only when the top tier
  evicts it (``MemoryStore.watch_spills`` hands the bytes over before dropping them) or at a
  clean stop (``flush``).
- An evicted dirty object is kept (its bytes, already in memory) until it is written: at most
  ``pending_bytes`` of them; a put that would evict more waits for the writer.
- Before writing an object down the writer checks it whole (header, checksum, MAC): it reads
  it from the top tier with ``get_into`` straight into its ring (no copy of the bytes between,
  and the top tier's own objects skip the MAC there, as its loads do), so a bad object in the
  top tier never reaches a lower one and is removed from the top tier as a load would.
- A lower tier whose peers can write its registered memory (Mooncake), with objects
  authenticated, gets the objects from a ring registered with it, but its checksum and MAC
  are made over a private copy (``put_from``'s ``originals``): the writer reads and checks
  each object in its private ring and copies it on into the registered one. A peer that
  writes the registered ring makes an object that fails its checks, never one its bytes pass.
- A lower tier that raises ``StorageUnavailable`` is skipped for ``DOWN_S`` (``TierHealth``):
  what it was to get is counted in ``write_failures``, and the top tier keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.errors import ObjectCorrupt, StorageUnavailable
from kvtier.memory.host import HostPool, copy_block
from kvtier.storage.base import Read, StorageBackend
from kvtier.storage.format import HEADER_BYTES

# A tier that could not be reached is not asked again for this long: each ask may cost a
# connect timeout, and a request must not pay it for every block.
DOWN_S = 1.0
# Objects written down per batch (the writer's own registered staging blocks).
WRITE_BATCH = 8
# Saved keys queued for writing through; beyond, a key stays dirty and is written down when
# evicted or at the stop (nothing is dropped; ``deferred`` counts them).
MAX_QUEUED = 65536

log = logging.getLogger(__name__)


class TierHealth:
    """Which tiers are up: one that raised ``StorageUnavailable`` is down for ``DOWN_S``."""

    def __init__(self, kinds: Sequence[str]) -> None:
        self.kinds = list(kinds)
        self._down_until = [0.0] * len(kinds)
        self.unavailable = [0] * len(kinds)  # calls that found the tier down

    def up(self, level: int) -> bool:
        return self._down_until[level] <= time.monotonic()

    def down(self, level: int, error: StorageUnavailable) -> None:
        if self.up(level):
            log.warning(
                "storage tier %d (%s) is unavailable (%s): skipped for %.0f s",
                level,
                self.kinds[level],
                error,
                DOWN_S,
            )
        self._down_until[level] = time.monotonic() + DOWN_S
        self.unavailable[level] += 1

    def ask(self, level: int, call, *args, default):
        """``call(*args)`` on tier ``level``; ``default`` if the tier is down."""
        try:
            return call(*args)
        except StorageUnavailable as e:
            self.down(level, e)
            return default


@dataclass
class WriterCounts:
    written: int = 0  # objects written down (to every live lower tier)
    write_failures: int = 0  # objects a lower tier did not take (down, full, failed, bad)
    deferred: int = 0  # keys not queued at their put (queue full): written when evicted


class LowerWriter:
    """Writes dirty objects of ``top`` down to ``lower`` on one thread (module docstring)."""

    def __init__(
        self,
        top: StorageBackend,
        lower: Sequence[StorageBackend],
        health: TierHealth,
        *,
        through: bool,
        pending_bytes: int,
    ) -> None:
        self.top, self.lower, self.health = top, list(lower), health
        self.through = through
        self.pending_bytes = pending_bytes
        self.counts = WriterCounts()
        self._cond = threading.Condition()
        self._dirty: set[str] = set()
        self._queue: OrderedDict[str, None] = OrderedDict()
        self._spilled: dict[str, bytes] = {}
        self._spilled_bytes = 0
        self._in_flight: set[str] = set()
        self._stopping = False
        self._on_drop: Callable[[list[str]], None] | None = None
        self._ring = HostPool(top.spec, WRITE_BATCH)
        for tier in self.lower:
            tier.register_host_pool(self._ring)
        self._private: HostPool | None = None  # where objects are read and checked
        if top.format.authenticated and any(t.exposes_registered_memory for t in self.lower):
            self._private = HostPool(top.spec, WRITE_BATCH)
        # Started by the first object to write down, not here: a chain that is built and
        # closed unused (a config check, a failed start) never has a thread to stop.
        self._thread = threading.Thread(target=self._run, name="kvtier-tier-writer", daemon=True)

    def _started(self) -> None:
        """The writing thread runs (called with ``_cond`` held, before anything is queued)."""
        if not self._thread.is_alive() and not self._stopping and self._thread.ident is None:
            self._thread.start()

    # ---- what the chain tells it ------------------------------------------------------------

    def saved(self, keys: Sequence[str]) -> None:
        """``keys`` are now in the top tier (and maybe in no lower one). Dirty since ``expect``:
        one the same put evicted may be written down already (then it is not queued again)."""
        with self._cond:
            keys = [key for key in keys if key in self._dirty]
            if not self.through:
                return
            self._started()
            for key in keys:
                if len(self._queue) < MAX_QUEUED:
                    self._queue[key] = None
                else:
                    self.counts.deferred += 1
            self._cond.notify_all()

    def expect(self, keys: Sequence[str]) -> None:
        """``keys`` are about to be put into the top tier: dirty from now on, so that one the
        same put evicts (a batch over the top tier's capacity) is handed over, not lost."""
        with self._cond:
            self._dirty.update(keys)

    def unexpect(self, keys: Sequence[str]) -> None:
        """The put did not store ``keys``: not dirty after all (unless already handed over)."""
        with self._cond:
            for key in keys:
                if key not in self._spilled:
                    self._dirty.discard(key)

    def spilled(self, objects: list[tuple[str, bytes]]) -> None:
        """The top tier evicted ``objects``: the dirty ones are kept until written down."""
        with self._cond:
            self._started()
            for key, data in objects:
                if key not in self._dirty or self._stopping:
                    continue
                while self._spilled_bytes > self.pending_bytes and self._thread.is_alive():
                    self._cond.wait(0.1)  # backpressure: the writer frees what it writes
                self._spilled[key] = data
                self._spilled_bytes += len(data)
                self._queue[key] = None
            self._cond.notify_all()

    def forget(self, keys: Sequence[str]) -> None:
        """``keys`` are being deleted or replaced: never write them down. Waits for a write of
        them under way (one batch), so the caller's delete below comes after it."""
        with self._cond:
            while self._in_flight.intersection(keys) and self._thread.is_alive():
                self._cond.wait(0.1)
            for key in keys:
                self._dirty.discard(key)
                self._queue.pop(key, None)
                data = self._spilled.pop(key, None)
                self._spilled_bytes -= len(data) if data is not None else 0

    def is_dirty(self, key: str) -> bool:
        """Whether ``key`` is still to be written down (its bytes held here or in the top)."""
        with self._cond:
            return key in self._dirty

    def watch_drops(self, listener: Callable[[list[str]], None]) -> None:
        """Tell ``listener`` the keys of evicted objects that could not be written down (every
        lower tier down, full or failing): they are gone from the chain. Called on the
        writer's thread, outside its lock."""
        self._on_drop = listener

    @property
    def pending(self) -> int:
        """Objects in the top tier that no lower tier holds yet."""
        with self._cond:
            return len(self._dirty)

    def flush(self, timeout_s: float) -> int:
        """Write every dirty object down (or give up at ``timeout_s``); how many are left."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._dirty:
                self._started()
            for key in self._dirty:
                self._queue[key] = None
            self._cond.notify_all()
            while (self._queue or self._in_flight) and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.1))
            return len(self._dirty)

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.ident is not None:
            self._thread.join()
        for tier in self.lower:
            tier.unregister_host_pool(self._ring)
        self._ring.close()
        if self._private is not None:
            self._private.close()

    # ---- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                batch: list[tuple[str, bytes | None]] = []
                while self._queue and len(batch) < WRITE_BATCH:
                    key, _ = self._queue.popitem(last=False)
                    batch.append((key, self._spilled.get(key)))
                self._in_flight = {key for key, _ in batch}
            try:
                done = self._write(batch)
            except Exception:  # never let the thread die: count and go on
                log.exception("writing %d objects down the tier chain failed", len(batch))
                done = {key: False for key, _ in batch}
            self._finish(done)

    def _write(self, batch: list[tuple[str, bytes | None]]) -> dict[str, bool]:
        """Check and copy each object into the ring, put them in every live lower tier (each
        hashes the payload for its own header: one pass over bytes already in the ring)."""
        keys: list[str] = []
        slots: list[int] = []
        done: dict[str, bool] = {}
        # Still in the top tier: read straight into the ring, checked there (no copy in between,
        # and the top tier's own objects skip the MAC, as its loads do).
        read_into = self._ring if self._private is None else self._private
        from_top = [key for key, data in batch if data is None]
        blocks = [read_into.block(i) for i in range(len(from_top))]
        got = self.top.read(Read(from_top, blocks, counted=False)).found  # not the engine's
        for slot, (key, read) in enumerate(zip(from_top, got)):
            if read:
                keys.append(key)
                slots.append(slot)
            elif self.top.found_corrupt(key):  # removed there: it will be recomputed
                log.warning("not writing %s down the tier chain: it failed its checks", key)
                done[key] = False
            # else evicted meanwhile (handed over again by its spill) or deleted
        for slot, (key, data) in enumerate(
            [(k, d) for k, d in batch if d is not None], start=len(from_top)
        ):
            block = read_into.block(slot)
            payload = memoryview(data)[HEADER_BYTES:]
            try:
                self.top.format.check(data[:HEADER_BYTES], [payload], key, block.numel())
            except ObjectCorrupt as e:
                log.warning("not writing %s down the tier chain: %s", key, e)
                done[key] = False
                continue
            block.numpy()[:] = payload
            keys.append(key)
            slots.append(slot)
        blocks, originals = self._into_ring(slots)
        stored = [True] * len(keys)
        for level, tier in enumerate(self.lower, start=1):
            if not keys:
                break
            if not self.health.up(level):
                stored = [False] * len(keys)
                continue
            try:
                ok = tier.put_from(keys, blocks, None, originals)
            except StorageUnavailable as e:
                self.health.down(level, e)
                ok = [False] * len(keys)
            stored = [a and b for a, b in zip(stored, ok)]
        done.update(zip(keys, stored))
        return done

    def _into_ring(self, slots: list[int]) -> tuple[list, list | None]:
        """The ring's blocks of ``slots``, and where they were copied from the private ring,
        those private blocks (the originals their checksum and MAC are made over)."""
        blocks = [self._ring.block(slot) for slot in slots]
        if self._private is None:
            return blocks, None
        originals = [self._private.block(slot) for slot in slots]
        for block, mine in zip(blocks, originals):
            copy_block(block, mine)
        return blocks, [[mine.numpy().data] for mine in originals]

    def _finish(self, done: dict[str, bool]) -> None:
        dropped = []
        with self._cond:
            for key, ok in done.items():
                self._dirty.discard(key)
                data = self._spilled.pop(key, None)
                self._spilled_bytes -= len(data) if data is not None else 0
                if data is not None and not ok:
                    dropped.append(key)  # evicted from the top, and now held nowhere
            # A key not in ``done`` was not read (evicted meanwhile): it is still dirty, and
            # its spill queued it again with its bytes.
            self.counts.written += sum(done.values())
            self.counts.write_failures += len(done) - sum(done.values())
            self._in_flight = set()
            self._cond.notify_all()
        if dropped and self._on_drop is not None:
            self._on_drop(dropped)
