"""The file store's view of what it holds: object names in least-recently-used order, with
sizes, rebuilt from the directory (mtime order) at start and every ``RESCAN_INTERVAL_S`` when
evicting (other processes sharing the store add and read objects too)."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable

log = logging.getLogger(__name__)

RESCAN_INTERVAL_S = 5.0


class LruIndex:
    """Thread-safe: object file name -> bytes, least recently used first."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._used = 0
        self._scanned_at = 0.0

    def usage(self) -> tuple[int, int]:
        """(bytes, objects)."""
        with self._lock:
            return self._used, len(self._sizes)

    def contains(self, name: str) -> bool:
        with self._lock:
            return name in self._sizes

    def add(self, name: str, size: int) -> None:
        with self._lock:
            old = self._sizes.pop(name, None)
            self._used += size - (old or 0)
            self._sizes[name] = size

    def touch(self, name: str) -> None:
        with self._lock:
            if name in self._sizes:
                self._sizes.move_to_end(name)

    def forget(self, name: str) -> None:
        with self._lock:
            self._used -= self._sizes.pop(name, 0)

    def over(self, capacity: int | None) -> bool:
        with self._lock:
            return capacity is not None and self._used > capacity

    def stale(self) -> bool:
        """Whether the last directory scan is older than ``RESCAN_INTERVAL_S``."""
        return time.monotonic() - self._scanned_at > RESCAN_INTERVAL_S

    def victims(self, capacity: int) -> list[str]:
        """Remove and return least-recently-used names until ``capacity`` is met."""
        out = []
        with self._lock:
            while self._used > capacity and self._sizes:
                name, size = self._sizes.popitem(last=False)
                self._used -= size
                out.append(name)
        return out

    def names(self) -> set[str]:
        with self._lock:
            return set(self._sizes)

    def merge(self, found: Iterable[tuple[float, str, int]], since: set[str]) -> None:
        """A fresh listing, (mtime, name, bytes) in any order, into the index without losing
        its recency: names it did not know go first (oldest modified first: least recently
        used), the known ones keep their order; a known name the listing lacks is gone (another
        writer removed it) unless it is not in ``since`` (added while the listing ran)."""
        listed = {name: size for _, name, size in sorted(found)}
        with self._lock:
            merged = OrderedDict((n, s) for n, s in listed.items() if n not in self._sizes)
            for name, size in self._sizes.items():
                if name in listed or name not in since:
                    merged[name] = listed.get(name, size)
            self._sizes = merged
            self._used = sum(merged.values())
            self._scanned_at = time.monotonic()

    def replace(self, found: Iterable[tuple[float, str, int]]) -> None:
        """The index from a directory scan: (mtime, name, bytes) in any order."""
        ordered = sorted(found)
        with self._lock:
            self._sizes = OrderedDict((name, size) for _, name, size in ordered)
            self._used = sum(size for _, _, size in ordered)
            self._scanned_at = time.monotonic()
