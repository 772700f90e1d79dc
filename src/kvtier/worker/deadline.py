"""When a worker stops touching a task's blocks: its client's deadline, less a guard.

A client gives each data task a timeout (``task_timeout_s``, 120 s by default). When it passes,
the engine counts the task failed and reuses its blocks: a load's blocks are recomputed, a
finished request's blocks are freed. A worker that went on with the task after that would write
a load into blocks that hold other data by then, or store a save read from blocks that another
request filled — wrong bytes, the second under a valid checksum and MAC, served to every later
hit. So every data task carries the time its client had left when it sent it
(``Task.timeout_ms``), and the worker's cutoff is that time from the task's arrival less a tenth
(``GUARD_FRACTION``): a device copy that starts before the cutoff ends long before the client
gives up (12 s of the default 120 s, about a hundred times a large task's copy here).

Past its cutoff a task is answered ``cancelled``, naming the deadline, without touching device
or engine host blocks. The cutoff is checked:
- before a task runs (every data task; the only check of swaps, lookups and host tasks): a
  task stalled on the store holds its direction, and the tasks queued behind it would
  otherwise run after their clients gave up (the common case);
- in the staged route, between a chunk's transfer from the store and its copy into device
  blocks (a store that stalls — a Mooncake node behind a failing link), and before each chunk
  of a save is copied out of them;
- in the direct route (a CPU cache with a local file or memory store), before the backend writes
  from the device blocks, and before each object a scattered read writes into them
  (``get_into_scattered``'s ``go_on``): a disk that stalls on one object lets that read land
  (it is in the kernel already) and no later one.

After a long stall thousands of queued tasks may pass their cutoff at once: ``CancelLog`` logs
one WARNING per ``LOG_INTERVAL_S`` and counts the rest (every one is in the task counters).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from kvtier.errors import DeadlinePassed

log = logging.getLogger(__name__)

GUARD_FRACTION = 0.1
LOG_INTERVAL_S = 10.0  # at most one WARNING this often for tasks cancelled past their cutoff
NO_CUTOFF = math.inf  # a task sent without a timeout (a client older than ``timeout_ms``)


def cutoff(task: Any) -> float:
    """The monotonic time after which ``task`` (just received) leaves its blocks alone."""
    timeout_ms = getattr(task, "timeout_ms", 0)
    if not timeout_ms:
        return NO_CUTOFF
    return time.monotonic() + timeout_ms * (1.0 - GUARD_FRACTION) / 1000.0


def check(until: float, task: Any, what: str) -> None:
    """Raise DeadlinePassed when ``until`` is over; ``what``: where the task stands."""
    if time.monotonic() > until:
        raise DeadlinePassed(
            f"cancelled {what}: its client's deadline ({task.timeout_ms / 1000:.1f} s, "
            "task_timeout_s) has passed or nearly so, and the engine may reuse its blocks; "
            "they were left alone"
        )


class CancelLog:
    """Logs a task answered ``cancelled`` past its cutoff: the first at once, then at most one
    line per ``interval_s``, each saying how many it did not log (thread-safe)."""

    def __init__(self, rank: int, interval_s: float = LOG_INTERVAL_S) -> None:
        self.rank, self.interval_s = rank, interval_s
        self._last = -math.inf
        self._unlogged = 0
        self._lock = threading.Lock()

    def __call__(self, task_id: int, error: DeadlinePassed) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval_s:
                self._unlogged += 1
                return
            unlogged, self._unlogged, self._last = self._unlogged, 0, now
        more = f" ({unlogged} more since the last such line, not logged)" if unlogged else ""
        log.warning("rank %d: task %d %s%s", self.rank, task_id, error, more)
