"""What a tier chain moves up: a block loaded from a lower tier is put into the top tier, so a
hot prefix is a memory hit from its second load.

The chain promotes what it checked itself (its ``read`` verifying here, its scattered reads);
where the caller checks the bytes (``Verify.ALL_BY_CALLER``: memory peers can write), the caller
hands them over once they passed: ``Promotion`` is the chain's ``Promotes``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.storage.base import StorageBackend
from kvtier.storage.chain.writer import TierHealth


class Promotion:
    def __init__(self, tiers: Sequence[StorageBackend], health: TierHealth) -> None:
        self.tiers, self.health = tiers, health
        self.count = 0  # blocks put into the top tier

    def promote(self, keys: Sequence[str], sources: Sequence[Sequence[memoryview]]) -> None:
        """Into the top tier, what it does not hold yet (the caller verified the bytes)."""
        top = self.tiers[0].scattered()
        if not keys or top is None or not self.health.up(0):
            return
        new = [
            i
            for i, key in enumerate(keys)
            if not self.health.ask(0, self.tiers[0].exists_prefix, [key], default=1)
        ]
        if new:
            self.put(top.put_from_scattered, [keys[i] for i in new], [sources[i] for i in new])

    def put(self, put: Callable[..., list[bool]], keys: Sequence[str], *args) -> None:
        """Put what was loaded from below into the top tier (``put``: its put)."""
        if self.health.up(0) and self.health.ask(0, put, keys, *args, default=None):
            self.count += len(keys)

    def loaded_from(self, level: int, keys: Sequence[str]) -> None:
        """``keys`` loaded from tier ``level``: a tier above that found its own copy bad marked
        them (``found_corrupt``); the load went on from here, so the marks are stale — left, a
        later load stopping at such a key for a plain miss would drop the sound objects after
        it."""
        for upper in self.tiers[:level]:
            for key in keys:
                upper.found_corrupt(key)  # asking forgets
