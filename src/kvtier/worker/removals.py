"""RemovedBlocks: block hashes whose stored objects went away, waiting to be told to the engine.

A worker's backend evicts objects for capacity (``StorageBackend.watch_removals``), and a
weight update retires every object of the old version at once. An engine that publishes what
kvtier holds (the vLLM connector's KV events) must hear of both: each save or load result
carries the hashes removed since the previous one (``Result.removed``), or ``all_removed`` after
a version change — or when more were removed than one message holds, since then the engine can
no longer know which. Only keys of this worker's namespace, layout, rank and current version
count (an old version's object evicted later removes nothing hittable). Thread-safe: evictions
are reported on the storage's I/O threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvtier.layout.keys import KeyScheme
from kvtier.transport.tasks import MAX_IDS_PER_TASK


class RemovedBlocks:
    def __init__(self, current: Callable[[], KeyScheme]) -> None:
        self._current = current  # this worker's key scheme now (its version changes)
        self._lock = threading.Lock()
        self._hashes: list[bytes] = []
        self._all = False

    def keys_evicted(self, keys: list[str]) -> None:
        scheme = self._current()
        mine = (scheme.namespace, scheme.version, scheme.fingerprint, scheme.rank)
        hashes = []
        for key in keys:
            parts = KeyScheme.parse(key)
            if (
                parts is None
                or (parts.namespace, parts.version, parts.fingerprint, parts.rank) != mine
            ):
                continue
            try:
                hashes.append(bytes.fromhex(parts.block_hash))
            except ValueError:
                continue
        with self._lock:
            if self._all:
                return
            self._hashes += hashes
            if len(self._hashes) > MAX_IDS_PER_TASK:
                self._hashes, self._all = [], True

    def retire_all(self) -> None:
        """Every object stored so far is unreachable (a new weight version)."""
        with self._lock:
            self._hashes, self._all = [], True

    def take(self) -> tuple[list[bytes], bool]:
        """(hashes removed, every earlier object removed) since the last call."""
        with self._lock:
            taken = self._hashes, self._all
            self._hashes, self._all = [], False
        return taken
