"""SaveWatch: how long the running save has been blocked on its store.

vLLM keeps a request's blocks until its saves are answered, and a worker runs its saves one at
a time (one thread per direction). Behind a save that waits seconds on a slow store (a congested
link, a stalled disk) every queued save holds its request's blocks for the whole queue: the KV
cache fills with finished requests and new ones queue for space. So once the running save has
been **blocked** — neither running nor waiting for a core — for ``SHED_AFTER_S`` and for longer
than its bytes take at ``SLOW_BYTES_PER_S`` (a big save to a sound store is not slow), the saves
queued behind it are answered ``cancelled`` at once (``TaskRunner.shed_queued_saves``): nothing
of them was written, the engine frees their blocks, and a later save writes them. The running
save goes on.

Blocked time, not wall time: on a machine short of CPU (a CPU hog, the engine's own threads) a
niced save thread waits for a core long before its store is slow, and that says nothing of the
store. The thread's run and run-queue times are read from ``/proc/self/task/<tid>/schedstat``;
where that cannot be read nothing is ever shed.
"""

from __future__ import annotations

import threading
import time

from kvtier.transport.tasks import Heartbeat

# A save blocked this long on its store shows a slow store: a fast one writes a request's
# blocks in milliseconds, a busy disk or link in tens of them. (vLLM's side declines saves
# to a store whose saves take 0.5 s: ``kvtier.vllm.decide.SLOW_SAVE_S``.)
SHED_AFTER_S = 1.0
SLOW_BYTES_PER_S = 64 << 20  # a store writing slower than this is slow whatever the save's size


def _schedstat(tid: int) -> tuple[float, float] | None:
    """(seconds run on a CPU, seconds waited on a run queue) of thread ``tid``."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat", "rb") as f:
            run_ns, wait_ns, *_ = f.read().split()
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return None


def core_wait_s() -> float | None:
    """Seconds the calling thread has waited on a run queue since it started (None where
    schedstat cannot be read): two readings around a task give its waits for a core."""
    times = _schedstat(threading.get_native_id())
    return None if times is None else times[1]


class SaveWatch:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # (thread id, its bytes, when it started, its run and wait seconds then) of the
        # save running now, and its blocks
        self._running: tuple[int, int, float, float, float] | None = None
        self._blocks = 0

    def started(self, nbytes: int, blocks: int = 0) -> None:
        """On the save thread, as a save of ``nbytes`` (``blocks`` blocks) starts."""
        tid = threading.get_native_id()
        times = _schedstat(tid)
        with self._lock:
            self._running = None if times is None else (tid, nbytes, time.monotonic(), *times)
            self._blocks = blocks

    def finished(self) -> float:
        """On the save thread, as its save ends: the seconds it waited for a core meanwhile
        (0.0 where that cannot be read) — time that says nothing of the store."""
        with self._lock:
            running, self._running = self._running, None
        times = None if running is None else _schedstat(running[0])
        if running is None or times is None:
            return 0.0
        return max(0.0, times[1] - running[4])

    def slow_store(self) -> float:
        """Seconds the running save has been blocked on its store, if that shows a slow store
        (module docstring); else 0.0 (also when no save runs, or its times cannot be read)."""
        nbytes, _, blocked = self._blocked()
        return blocked if blocked >= max(SHED_AFTER_S, nbytes / SLOW_BYTES_PER_S) else 0.0

    def blocked(self) -> tuple[int, float]:
        """(blocks, seconds blocked on its store) of the running save; ``(0, 0.0)`` when none
        runs or its times cannot be read. The engine's load-or-recompute reads it on heartbeats
        (``kvtier.vllm.decide``): a slow store seen before its first save is answered."""
        _, blocks, blocked = self._blocked()
        return (blocks, blocked) if blocked > 0 else (0, 0.0)

    def echo(self, beat: Heartbeat) -> Heartbeat:
        """A heartbeat's echo to an engine: its stamp, and the running save's blocks and time
        blocked on its store (``blocked``)."""
        blocks, blocked_s = self.blocked()
        return Heartbeat(sent_at=beat.sent_at, save_blocked_s=blocked_s, save_blocks=blocks)

    def _blocked(self) -> tuple[int, int, float]:
        with self._lock:
            running, blocks = self._running, self._blocks
        if running is None:
            return 0, 0, 0.0
        tid, nbytes, since, run0, wait0 = running
        times = _schedstat(tid)
        if times is None:
            return nbytes, blocks, 0.0
        run, wait = times
        return nbytes, blocks, (time.monotonic() - since) - (run - run0) - (wait - wait0)
