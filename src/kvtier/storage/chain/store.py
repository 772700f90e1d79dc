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
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.errors import StorageError, StorageUnavailable
from kvtier.storage.base import StorageBackend, StorageStats, StorageUsage
from kvtier.storage.chain.removals import ChainRemovals
from kvtier.storage.chain.writer import LowerWriter, TierHealth
from kvtier.storage.config import WRITE_MODES
from kvtier.storage.format import ObjectFormat

log = logging.getLogger(__name__)


class TieredStore(StorageBackend):
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
        if len(tiers) < 1:
            raise StorageError("a tier chain needs at least one tier")
        if write not in WRITE_MODES:
            raise StorageError(f"write must be one of {', '.join(WRITE_MODES)}, got {write!r}")
        self.tiers = list(tiers)  # before the base sets ``format`` (passed on to every tier)
        super().__init__(tiers[0].spec, mac_key)
        self.write, self.flush_timeout_s = write, flush_timeout_s
        self.health = TierHealth([t.wrapped.kind for t in self.tiers])
        self.promotions = 0
        self.writer: LowerWriter | None = None
        if len(self.tiers) > 1:
            self.writer = LowerWriter(
                self.tiers[0],
                self.tiers[1:],
                self.health,
                through=write == "through",
                pending_bytes=pending_bytes,
            )
            watch_spills = getattr(self.tiers[0], "watch_spills", None)
            if watch_spills is not None:
                watch_spills(self.writer.spilled)
            elif write == "back":
                raise StorageError(
                    "write: back needs a memory tier on top (it hands over what it evicts)"
                )

    # ---- what the chain shares with its tiers ------------------------------------------------

    @property
    def format(self) -> ObjectFormat:
        return self._format

    @format.setter
    def format(self, value: ObjectFormat) -> None:
        self._format = value
        for tier in self.tiers:
            tier.format = value

    @property
    def stats(self) -> StorageStats:
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

    @stats.setter
    def stats(self, value: StorageStats) -> None:
        self._own = value

    @property
    def quick_lookups(self) -> bool:  # type: ignore[override]
        return all(t.quick_lookups for t in self.tiers)

    @property
    def supports_scattered_reads(self) -> bool:
        return all(t.supports_scattered_reads for t in self.tiers)

    @property
    def reads_scattered_on_top(self) -> bool:
        return self.tiers[0].supports_scattered_reads

    @property
    def exposes_registered_memory(self) -> bool:
        return any(t.exposes_registered_memory for t in self.tiers)

    @property
    def persistent(self) -> bool:
        return any(t.persistent for t in self.tiers)

    def _live(self) -> list[tuple[int, StorageBackend]]:
        live = [(level, t) for level, t in enumerate(self.tiers) if self.health.up(level)]
        if not live:
            raise StorageUnavailable("every storage tier is unavailable")
        return live

    def _answered(self, result):
        """``result``, unless every tier turned out to be down while it was computed."""
        self._live()
        return result

    # ---- the contract ------------------------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        return self.prefix_tiers(keys)[0]

    def prefix_tiers(self, keys: Sequence[str]) -> tuple[int, bytes]:
        """Runs of the prefix, each from the fastest live tier that holds its first block."""
        levels, live = bytearray(), self._live()
        while len(levels) < len(keys):
            for level, tier in live:
                found = self.health.ask(level, tier.exists_prefix, keys[len(levels) :], default=0)
                if found:
                    levels += bytes([level]) * found
                    break
            else:
                break
        return self._answered((len(levels), bytes(levels) if any(levels) else b""))

    def get_into(self, keys, host_blocks, checksums_out=None, headers_out=None) -> list[bool]:
        """Each block from the fastest tier that holds it; those from below promoted, unless
        the caller checks the bytes itself (``headers_out``: it calls ``promote`` after)."""
        self._check_batch(keys, host_blocks, checksums_out, headers_out, blocks=False)  # in a tier
        results, below = [False] * len(keys), []
        todo = list(range(len(keys)))
        for level, tier in self._live():
            if not todo:
                break
            got = _get_from(self, level, tier, keys, host_blocks, todo, checksums_out, headers_out)
            below += [i for i in got if level > 0]
            for i in got:
                results[i] = True
            todo = [i for i in todo if not results[i]]
        prefix = results.index(False) if False in results else len(results)
        promote = [i for i in below if i < prefix]
        if promote and headers_out is None:
            known = None if checksums_out is None else [int(checksums_out[i]) for i in promote]
            blocks = [host_blocks[i] for i in promote]
            self._promote("put_from", [keys[i] for i in promote], blocks, known)
        return self._count(self._answered(results))

    def promote(self, keys, sources) -> None:
        """Into the top tier, what it does not hold yet (the caller verified the bytes)."""
        top = self.tiers[0]
        if not keys or not top.supports_scattered_reads or not self.health.up(0):
            return
        new = [
            i
            for i, key in enumerate(keys)
            if not self.health.ask(0, top.exists_prefix, [key], default=1)
        ]
        if new:
            self._promote("put_from_scattered", [keys[i] for i in new], [sources[i] for i in new])

    def get_into_scattered(self, keys, targets, go_on=None) -> list[bool]:
        """Each block from the fastest tier that reads scattered and holds it; a block only the
        others hold ends the run (``reads_scattered_on_top``)."""
        start, up = 0, self._live()
        live = [(level, t) for level, t in up if t.supports_scattered_reads]
        self._check_scattered(keys, targets, sizes=not live)  # else by the first live tier
        while start < len(keys):
            for level, tier in live:
                args = (keys[start:], targets[start:], go_on)
                got = self.health.ask(
                    level, tier.get_into_scattered, *args, default=[False] * len(args[0])
                )
                run = got.index(False) if False in got else len(got)
                if run:
                    if level > 0:  # verified bytes: the top tier hashes them itself
                        _sound_below(self, level, keys[start : start + run])
                        self._promote(
                            "put_from_scattered",
                            keys[start : start + run],
                            targets[start : start + run],
                        )
                    start += run
                    break
            else:
                break
        results = self._answered([True] * start + [False] * (len(keys) - start))
        if len(live) < len(up):  # the rest is asked for with get_into, which counts it
            self._own.add(hits=start)
            return results
        return self._count(results)

    def put_from(self, keys, host_blocks, checksums=None, originals=None) -> list[bool]:
        self._check_batch(keys, host_blocks, checksums)
        return self._put(keys, "put_from", host_blocks, checksums, originals)

    def put_from_scattered(self, keys, sources) -> list[bool]:
        self._check_scattered(keys, sources)
        return self._put(keys, "put_from_scattered", sources)

    def _put(self, keys, method: str, *args) -> list[bool]:
        """Into the first live tier (the top unless down) taking such puts; below: the writer."""
        scattered = method == "put_from_scattered"
        for level, tier in self._live():
            if scattered and not tier.supports_scattered_reads:
                continue
            writer = self.writer if level == 0 else None
            if writer:  # dirty before the put: one it evicts at once is kept
                writer.expect(keys)
            try:
                ok = getattr(tier, method)(keys, *args)
            except StorageUnavailable as e:
                self.health.down(level, e)
                if writer:
                    writer.unexpect(keys)
                continue
            if writer:
                writer.unexpect([k for k, stored in zip(keys, ok) if not stored])
                writer.saved([k for k, stored in zip(keys, ok) if stored])
            return self._count(ok, "puts", "put_failures")
        which = " that writes from a device block's pieces" if scattered else ""
        raise StorageUnavailable(f"every storage tier{which} is unavailable")

    def _promote(self, method: str, keys, *args) -> None:
        """Put what was loaded from below into the top tier (``method``: its put)."""
        put = getattr(self.tiers[0], method)
        if self.health.up(0) and self.health.ask(0, put, keys, *args, default=None):
            self.promotions += len(keys)

    def _count(self, results: list[bool], hit: str = "hits", miss: str = "misses") -> list[bool]:
        self._own.add(**{hit: sum(results), miss: len(results) - sum(results)})
        return results

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


def _sound_below(chain: TieredStore, level: int, keys) -> None:
    """``keys`` loaded from tier ``level``: a tier above that found its own copy bad marked
    them (``found_corrupt``); the load went on from here, so the marks are stale — left, a
    later load stopping at such a key for a plain miss would drop the sound objects after it."""
    for upper in chain.tiers[:level]:
        for key in keys:
            upper.found_corrupt(key)  # asking forgets


def _get_from(chain, level, tier, keys, host_blocks, todo, checksums_out, headers_out) -> list[int]:
    """``tier.get_into`` of the blocks ``todo``; the ones it loaded (their checksums and
    headers copied out where asked for). A tier that is down loads none."""
    sums = None if checksums_out is None else np.zeros(len(todo), dtype=np.uint64)
    heads: list[bytes | None] | None = None if headers_out is None else [None] * len(todo)
    got = chain.health.ask(
        level,
        tier.get_into,
        [keys[i] for i in todo],
        [host_blocks[i] for i in todo],
        sums,
        heads,
        default=[False] * len(todo),
    )
    loaded = [i for i, ok in zip(todo, got) if ok]
    _sound_below(chain, level, [keys[i] for i in loaded])
    for j, (i, ok) in enumerate(zip(todo, got)):
        if ok and sums is not None:
            checksums_out[i] = sums[j]
        if ok and heads is not None:
            headers_out[i] = heads[j]
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
    rows[0]["promotions"] = chain.promotions
    if chain.writer is not None:
        rows[0]["pending_writes"] = chain.writer.pending
        rows[0].update(vars(chain.writer.counts))
    return rows
