"""A tier chain's reads into (and writes from) a CPU device block's pieces: its ``ScatteredIO``,
where its top tier has one.

A read takes each block from the fastest live tier that reads scattered and holds it; a block
that only tiers reading host blocks hold (Mooncake, S3 below memory) ends the run
(``covers_all`` False), and the caller reads on through host blocks (``kvtier.worker.routes``).
Blocks read from a lower tier are verified there, so they are promoted at once. A write goes
into the first live tier that writes from pieces, and down the chain as any save does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from kvtier.storage.base import StorageBackend
from kvtier.storage.chain.promotion import Promotion
from kvtier.storage.chain.writer import TierHealth
from kvtier.storage.object_store import check_scattered


class Chain(Protocol):
    """What this needs of its chain (``kvtier.storage.chain.store.TieredStore``)."""

    tiers: list[StorageBackend]
    health: TierHealth
    promotion: Promotion

    @property
    def payload_bytes(self) -> int: ...

    def live_tiers(self) -> list[tuple[int, StorageBackend]]: ...

    def answered(self, result: Any) -> Any: ...

    def count_reads(self, results: list[bool]) -> list[bool]: ...

    def count_hits(self, n: int) -> None: ...

    def put_into(self, keys: Sequence[str], method: str, *args: Any) -> list[bool]: ...


class ChainScattered:
    def __init__(self, chain: Chain) -> None:
        self.chain = chain

    @property
    def covers_all(self) -> bool:
        return all(t.scattered() is not None for t in self.chain.tiers)

    def get_into_scattered(self, keys, targets, go_on=None) -> list[bool]:
        """Each block from the fastest tier that reads scattered and holds it; a block only the
        others hold ends the run (``covers_all``)."""
        chain = self.chain
        top = chain.tiers[0].scattered()  # not None: the chain offers this only then
        start, up = 0, chain.live_tiers()
        live = [(level, io) for level, t in up if (io := t.scattered()) is not None]
        check_scattered(keys, targets, None if live else chain.payload_bytes)  # else by a tier
        while start < len(keys):
            for level, io in live:
                args = (keys[start:], targets[start:], go_on)
                got = chain.health.ask(
                    level, io.get_into_scattered, *args, default=[False] * len(args[0])
                )
                run = got.index(False) if False in got else len(got)
                if run:
                    if level > 0 and top is not None:  # verified: the top tier hashes them
                        chain.promotion.loaded_from(level, keys[start : start + run])
                        chain.promotion.put(
                            top.put_from_scattered,
                            keys[start : start + run],
                            targets[start : start + run],
                        )
                    start += run
                    break
            else:
                break
        results = chain.answered([True] * start + [False] * (len(keys) - start))
        if len(live) < len(up):  # the rest is asked for with ``read``, which counts it
            chain.count_hits(start)
            return results
        return chain.count_reads(results)

    def put_from_scattered(self, keys, sources) -> list[bool]:
        check_scattered(keys, sources, self.chain.payload_bytes)
        return self.chain.put_into(keys, "put_from_scattered", sources)
