"""TieredStore: backends chained fastest first (host memory, then disk, then the cluster)
behind the one storage contract, so a worker, the vLLM connector and the demo use a chain
exactly as they use one backend.

- **Lookup**: the longest prefix over all tiers; each block may sit in any of them.
- **Loads**: each block from the fastest tier that holds it. A block loaded from a lower tier
  is *promoted*: put into the top tier before the load answers, under the checksum it was
  stored with, so a payload that is bad is still caught by the caller's check (and then
  removed from every tier). Promotion makes a hot prefix a memory hit from its second load.
- **Saves** go into the top tier; the lower tiers get them from one writer thread
  (``kvtier.storage.chain.writer``): ``write: through`` at once, ``write: back`` when the top
  tier evicts them or at a clean stop. Nothing dirty is dropped on eviction; ``close`` waits
  up to ``flush_timeout_s`` for what is still to be written.
- **A tier that is down** (``StorageUnavailable``) is skipped for a second at a time and costs
  only its own hits; the chain raises ``StorageUnavailable`` only when every tier is down.
- Checksums, MAC and the weight-versioned keys are every tier's own, as with one backend.
- ``read_object`` reads from the first tier that holds the key; ``write_object`` replaces the
  object in the top tier and removes it from the others (fault injection sees one object).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.errors import StorageError, StorageUnavailable
from kvtier.storage.base import (
    Promotes,
    Read,
    ReadResult,
    ScatteredIO,
    StorageBackend,
    StorageStats,
    StorageUsage,
    Verify,
)
from kvtier.storage.chain.promotion import Promotion
from kvtier.storage.chain.removals import ChainRemovals
from kvtier.storage.chain.scattered import ChainScattered
from kvtier.storage.chain.writer import LowerWriter, TierHealth
from kvtier.storage.config import WRITE_MODES
from kvtier.storage.format import ObjectFormat
from kvtier.storage.object_store import check_batch
from kvtier.storage.wrappers.delegating import Delegating

log = logging.getLogger(__name__)


class TieredStore(Delegating):
    """Its ``inner`` is the top tier: the format and block sizes are every tier's alike."""

    kind = "tiers"

    def __init__(
        self,
        tiers: Sequence[StorageBackend],
        *,
        write: str = "through",
        pending_bytes: int = 256 << 20,
        flush_timeout_s: float = 10.0,
        mac_key: bytes | None = None,
    ) -> None:
        """``mac_key``: every tier's objects authenticated with it (None: as each tier is)."""
        if len(tiers) < 1:
            raise StorageError("a tier chain needs at least one tier")
        if write not in WRITE_MODES:
            raise StorageError(f"write must be one of {', '.join(WRITE_MODES)}, got {write!r}")
        super().__init__(tiers[0])
        self.tiers = list(tiers)
        if mac_key is not None:
            self.format = ObjectFormat(tiers[0].spec.fingerprint, mac_key)
        self.write, self.flush_timeout_s = write, flush_timeout_s
        self._own = StorageStats()  # the engine's reads and writes of the chain
        self._removal_listener: Callable[[list[str]], None] | None = None
        self.health = TierHealth([t.wrapped.kind for t in self.tiers])
        self.promotion = Promotion(self.tiers, self.health)
        self._scattered = ChainScattered(self)
        self.writer: LowerWriter | None = None
        if len(self.tiers) > 1:
            self.writer = LowerWriter(
                self.tiers[0],
                self.tiers[1:],
                self.health,
                through=write == "through",
                pending_bytes=pending_bytes,
            )
            watch_spills = getattr(self.tiers[0].wrapped, "watch_spills", None)
            if watch_spills is not None:
                watch_spills(self.writer.spilled)
            elif write == "back":
                raise StorageError(
                    "write: back needs a memory tier on top (it hands over what it evicts)"
                )

    # ---- what the chain shares with its tiers ------------------------------------------------

    @property
    def format(self) -> ObjectFormat:
        return self.tiers[0].format

    @format.setter
    def format(self, value: ObjectFormat) -> None:
        for tier in self.tiers:
            tier.format = value

    @property
    def stats(self) -> StorageStats:  # type: ignore[override]
        """The chain's reads and writes; corrupt objects and evictions summed over its tiers."""
        own = self._own
        return StorageStats(
            hits=own.hits,
            misses=own.misses,
            puts=own.puts,
            put_failures=own.put_failures,
            corrupt=sum(t.stats.corrupt for t in self.tiers),
            evictions=sum(t.stats.evictions for t in self.tiers),
        )

    @property
    def quick_lookups(self) -> bool:  # type: ignore[override]
        return all(t.quick_lookups for t in self.tiers)

    def scattered(self) -> ScatteredIO | None:
        """Where the top tier reads scattered: ``ChainScattered``, over the tiers that do."""
        return self._scattered if self.tiers[0].scattered() is not None else None

    def promoter(self) -> Promotes:
        return self.promotion

    @property
    def exposes_registered_memory(self) -> bool:
        return any(t.exposes_registered_memory for t in self.tiers)

    @property
    def persistent(self) -> bool:
        return any(t.persistent for t in self.tiers)

    @property
    def wrapped(self) -> StorageBackend:
        return self

    def live_tiers(self) -> list[tuple[int, StorageBackend]]:
        live = [(level, t) for level, t in enumerate(self.tiers) if self.health.up(level)]
        if not live:
            raise StorageUnavailable("every storage tier is unavailable")
        return live

    def answered(self, result):
        """``result``, unless every tier turned out to be down while it was computed."""
        self.live_tiers()
        return result

    # ---- the contract ------------------------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        return self.prefix_tiers(keys)[0]

    def prefix_tiers(self, keys: Sequence[str]) -> tuple[int, bytes]:
        """Runs of the prefix, each from the fastest live tier that holds its first block."""
        levels, live = bytearray(), self.live_tiers()
        while len(levels) < len(keys):
            for level, tier in live:
                found = self.health.ask(level, tier.exists_prefix, keys[len(levels) :], default=0)
                if found:
                    levels += bytes([level]) * found
                    break
            else:
                break
        return self.answered((len(levels), bytes(levels) if any(levels) else b""))

    def holds(self, key: str) -> bool:
        return any(
            self.health.ask(level, t.holds, key, default=False) for level, t in self.live_tiers()
        )

    def read(self, request: Read) -> ReadResult:
        """Each block from the fastest tier that holds it; those from below promoted, unless
        the caller checks the bytes itself (``Verify.ALL_BY_CALLER``: it promotes them after)."""
        keys, host_blocks = request.keys, request.host_blocks
        if len(keys) != len(host_blocks):  # the blocks themselves: by the tier that reads them
            raise StorageError(f"{len(keys)} keys but {len(host_blocks)} host blocks")
        result, below = ReadResult.empty(request), []
        todo = list(range(len(keys)))
        for level, tier in self.live_tiers():
            if not todo:
                break
            got = _get_from(self, level, tier, request, todo, result)
            below += [i for i in got if level > 0]
            todo = [i for i in todo if not result.found[i]]
        promote = [i for i in below if i < result.leading]
        if promote and request.verify is not Verify.ALL_BY_CALLER:
            sums = result.checksums
            known = None if sums is None else [int(sums[i]) for i in promote]
            blocks = [host_blocks[i] for i in promote]
            self.promotion.put(self.tiers[0].put_from, [keys[i] for i in promote], blocks, known)
        self.answered(result)
        if request.counted:
            self.count_reads(result.found)
        return result

    def put_from(self, keys, host_blocks, checksums=None, originals=None) -> list[bool]:
        check_batch(keys, host_blocks, self.payload_bytes, checksums)
        return self.put_into(keys, "put_from", host_blocks, checksums, originals)

    def put_into(self, keys, method: str, *args) -> list[bool]:
        """Into the first live tier (the top unless down) taking such puts; below: the writer."""
        scattered = method == "put_from_scattered"
        for level, tier in self.live_tiers():
            target = tier.scattered() if scattered else tier
            if target is None:
                continue
            writer = self.writer if level == 0 else None
            if writer:  # dirty before the put: one it evicts at once is kept
                writer.expect(keys)
            try:
                ok = getattr(target, method)(keys, *args)
            except StorageUnavailable as e:
                self.health.down(level, e)
                if writer:
                    writer.unexpect(keys)
                continue
            if writer:
                writer.unexpect([k for k, stored in zip(keys, ok) if not stored])
                writer.saved([k for k, stored in zip(keys, ok) if stored])
            return self.count_reads(ok, "puts", "put_failures")
        which = " that writes from a device block's pieces" if scattered else ""
        raise StorageUnavailable(f"every storage tier{which} is unavailable")

    def count_reads(
        self, results: list[bool], hit: str = "hits", miss: str = "misses"
    ) -> list[bool]:
        """The engine's reads (or, with ``puts``/``put_failures``, writes) of the chain."""
        self._own.add(**{hit: sum(results), miss: len(results) - sum(results)})
        return results

    def count_hits(self, n: int) -> None:
        """Hits of a read whose misses the caller asks for again (and then counts)."""
        self._own.add(hits=n)

    def delete(self, keys: Sequence[str]) -> int:
        if self.writer is not None:
            self.writer.forget(keys)
        removed = 0
        for level, tier in enumerate(self.tiers):
            removed = max(removed, self.health.ask(level, tier.delete, keys, default=0))
        return removed

    def found_corrupt(self, key: str) -> bool:
        return any([tier.found_corrupt(key) for tier in self.tiers])  # each forgets it

    def report_corrupt(self, key: str, reason: str) -> None:
        """Counted once (top tier); the object is removed from every tier."""
        self.tiers[0].report_corrupt(key, reason)
        self.delete([key])

    def usage(self) -> StorageUsage:
        """The usage of the tier holding the most objects (the chain holds at least those;
        a lower tier mostly holds copies of the top one's). Each tier's: ``tier_usage``."""
        known = [u for u in self.tier_usage() if u is not None]
        if not known:
            raise StorageUnavailable("every storage tier is unavailable")
        return max(known, key=lambda u: u.num_objects)

    def tier_usage(self) -> list[StorageUsage | None]:
        """Each tier's usage (None: the tier is down)."""
        return [self.health.ask(level, t.usage, default=None) for level, t in enumerate(self.tiers)]

    def read_object(self, key: str) -> bytes | None:
        for tier in self.tiers:
            data = tier.read_object(key)
            if data is not None:
                return data
        return None

    def write_object(self, key: str, data: bytes) -> None:
        if self.writer is not None:
            self.writer.forget([key])
        for tier in self.tiers[1:]:
            tier.delete([key])
        self.tiers[0].write_object(key, data)

    def watch_removals(self, listener) -> None:
        """Keys that left the chain: no tier holds them any more (``chain.removals``)."""
        self._removal_listener = listener
        ChainRemovals(self.tiers, self.writer, self._evicted)

    def _evicted(self, keys: list[str]) -> None:
        if keys and self._removal_listener is not None:
            self._removal_listener(keys)

    def register_host_pool(self, pool, blocks: range | None = None) -> None:
        for tier in self.tiers:
            tier.register_host_pool(pool, blocks)

    def unregister_host_pool(self, pool) -> None:
        for tier in self.tiers:
            tier.unregister_host_pool(pool)

    def tier_stats(self) -> list[dict[str, Any]]:
        """Per tier: its kind, its counters, and the chain's promotions and writes down."""
        return _tier_rows(self)

    def close(self) -> None:
        if self.writer is not None:
            left = self.writer.flush(self.flush_timeout_s)
            if left:
                log.warning(
                    "tier chain closed with %d objects not written to its lower tiers "
                    "(flush_timeout_s=%.0f)",
                    left,
                    self.flush_timeout_s,
                )
            self.writer.close()
            self.writer = None
        for tier in self.tiers:
            tier.close()


def _get_from(chain, level, tier, request: Read, todo: list[int], result: ReadResult) -> list[int]:
    """``tier.read`` of the blocks ``todo`` into ``result``; the ones it loaded. A tier that is
    down loads none."""
    sub = Read(
        [request.keys[i] for i in todo],
        [request.host_blocks[i] for i in todo],
        request.verify,
        counted=request.counted,
    )
    got = chain.health.ask(level, tier.read, sub, default=None)
    if got is None:
        return []
    loaded = [i for i, ok in zip(todo, got.found) if ok]
    chain.promotion.loaded_from(level, [request.keys[i] for i in loaded])
    for j, (i, ok) in enumerate(zip(todo, got.found)):
        if not ok:
            continue
        result.found[i] = True
        if result.checksums is not None:
            result.checksums[i] = got.checksums[j]
        if result.headers is not None:
            result.headers[i] = got.headers[j]
    return loaded


def _tier_rows(chain: TieredStore) -> list[dict[str, Any]]:
    rows = []
    for level, tier in enumerate(chain.tiers):
        rows.append(
            {
                "tier": level,
                "backend": tier.kind,
                **tier.stats.as_dict(),
                "unavailable": chain.health.unavailable[level],
            }
        )
    rows[0]["promotions"] = chain.promotion.count
    if chain.writer is not None:
        rows[0]["pending_writes"] = chain.writer.pending
        rows[0].update(vars(chain.writer.counts))
    return rows
