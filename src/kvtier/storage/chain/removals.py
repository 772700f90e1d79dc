"""Which evictions remove an object from a tier chain — the KV events a router replays.

An object is in the chain while any tier holds it. A tier's eviction removes it from the chain
only if no other tier holds it and the writer is not still writing it down; a dirty object the
writer then fails to write down (every lower tier down, full or failing) leaves the chain when
the writer gives up. So the router's view (stored minus removed) is the chain's content, whichever
tier evicts: the memory tier spilling, the file tier at its capacity, the last tier's own LRU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from kvtier.storage.base import StorageBackend
from kvtier.storage.chain.writer import LowerWriter


class ChainRemovals:
    """Listens to every tier of a chain (and its writer) and tells ``removed`` the keys that
    left the chain. Called on the evicting thread: ``holds`` asks tiers what they know."""

    def __init__(
        self,
        tiers: Sequence[StorageBackend],
        writer: LowerWriter | None,
        removed: Callable[[list[str]], None],
    ) -> None:
        self.tiers, self.writer, self.removed = list(tiers), writer, removed
        for level, tier in enumerate(self.tiers):
            tier.watch_removals(partial(self.evicted, level))
        if writer is not None:
            writer.watch_drops(partial(self.evicted, -1))

    def evicted(self, level: int, keys: list[str]) -> None:
        """Tier ``level`` (-1: the writer, dropping) no longer holds ``keys``."""
        others = [t for i, t in enumerate(self.tiers) if i != level]
        gone = [k for k in keys if not self._dirty(k) and not any(t.holds(k) for t in others)]
        if gone:
            self.removed(gone)

    def _dirty(self, key: str) -> bool:
        return self.writer is not None and self.writer.is_dirty(key)
