"""TaskCounters: a worker's task, byte and error counts, fed to stats() and the metrics."""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from typing import Any

SAVES = ("save", "save_host")


class TaskCounters:
    """Thread-safe counters per task kind (tasks, bytes, microseconds, statuses) and errors."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tasks: dict[str, Counter] = defaultdict(Counter)
        self._errors: Counter = Counter()

    def task(
        self,
        kind: str,
        status: str,
        nbytes: int,
        seconds: float,
        metrics: Any,
        blocks: int = 0,
        skipped: int = 0,
    ) -> None:
        """One answered task; saves say how many ``blocks`` they stored, ``skipped`` of them
        already there (not written again)."""
        with self._lock:
            c = self._tasks[kind]
            c["tasks"] += 1
            c["bytes"] += nbytes
            if kind in SAVES:
                c["blocks_written"] += blocks - skipped
                c["blocks_skipped"] += skipped
            c["microseconds"] += int(seconds * 1e6)
            c[status] += 1
        if metrics is not None:
            metrics.task(kind, status, nbytes, seconds)

    def error(self, kind: str, metrics: Any) -> None:
        with self._lock:
            self._errors[kind] += 1
        if metrics is not None:
            metrics.error(kind)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "tasks": {k: dict(v) for k, v in self._tasks.items()},
                "errors": dict(self._errors),
            }


def tier_rows(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """A worker's ``storage_tiers``, one row per tier with its rank, level and backend."""
    kinds = str(stats.get("storage_backend", "")).split("+")
    return [
        dict(counts, rank=stats["rank"], tier=int(level), backend=kinds[int(level)])
        for level, counts in stats.get("storage_tiers", {}).items()
        if int(level) < len(kinds)
    ]
