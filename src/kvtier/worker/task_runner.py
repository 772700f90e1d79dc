"""TaskRunner: where a worker's admitted data tasks run, and how each is answered.

One single-thread executor per direction (swap_out, swap_in, save, load, host_io, lookup), so
a slow storage write never delays a swap-in; FIFO within a direction. A small swap, or a lookup
of a store that answers from memory, whose direction is idle runs on the loop thread right
after admission (no thread hand-off either way; FIFO holds because nothing is queued ahead).
Save threads run at a lower priority: saves are off the engine's critical path, and on a
machine whose cores the engine keeps busy (vLLM on CPU runs OpenMP on every core; one
preempted thread stalls a whole parallel region) they take idle time rather than the engine's.

Every task gets exactly one Result: its outcome, an error naming the cause (a ``KvtierError``
from bad input, or an internal error, logged with its traceback: the worker goes on), or
``cancelled`` when the worker stops before it ran, or when it is a save queued behind a save
blocked on a slow store (``kvtier.worker.save_watch``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvtier.errors import DeadlinePassed, KvtierError
from kvtier.layout.keys import KeyScheme
from kvtier.transport import tasks as t
from kvtier.transport.base import Peer
from kvtier.worker import deadline
from kvtier.worker.datapath import Outcome
from kvtier.worker.gate import Gate
from kvtier.worker.resources import RankResources
from kvtier.worker.save_watch import SaveWatch, core_wait_s
from kvtier.worker.stats import TaskCounters

log = logging.getLogger(__name__)

# Swaps this small run on the loop thread when their direction is idle (microseconds of copying),
# and so do lookups of a store that answers them from memory (``quick_lookups``).
INLINE_MAX_BLOCKS = 4
INLINE_TASKS = (t.SwapOut, t.SwapIn)
QUIET_DIRECTIONS = (t.Direction.SWAP_OUT, t.Direction.SWAP_IN, t.Direction.LOOKUP)
BACKGROUND_DIRECTIONS = (t.Direction.SAVE,)
BACKGROUND_NICE = 10
# Results that carry the blocks removed from storage since the last (``kvtier.worker.removals``).
STORAGE_TASKS = (t.Save, t.Load, t.SaveHost, t.LoadHost)
SAVES = (t.Save, t.SaveHost)

# (peer, data task, the keys it was stamped with, when it leaves its blocks: ``deadline``)
Item = tuple[Peer, Any, KeyScheme, float]
Send = Callable[[Peer, bytes], None]  # an encoded Result


class TaskRunner:
    def __init__(
        self,
        resources: RankResources,
        gate: Gate,
        counters: TaskCounters,
        send: Send,
        metrics: Callable[[], Any],
        rank: int,
    ) -> None:
        self.resources, self.gate, self.counters = resources, gate, counters
        self.rank = rank
        self._send, self._metrics = send, metrics
        self.executors = {
            d: ThreadPoolExecutor(
                1,
                thread_name_prefix=f"kvtier-{d.value}",
                initializer=_lower_priority if d in BACKGROUND_DIRECTIONS else None,
            )
            for d in t.Direction
        }
        self._lock = threading.Lock()
        self._pending: dict[Future, Item] = {}
        self._busy: Counter = Counter()  # per direction: submitted, not finished
        self._queued: Counter = Counter()  # per direction: submitted, not started
        self._inline: list[Item] = []
        self.loop_ident = 0  # the loop thread, where small idle swaps run inline
        self.save_watch = SaveWatch()
        self._cancel_log = deadline.CancelLog(rank)

    def submit(self, item: Item) -> None:
        """Run ``item`` (called under the gate's lock, by the loop thread or a resume)."""
        task = item[1]
        direction = t.DIRECTIONS[type(task)]
        with self._lock:
            busy = self._busy[direction]
            self._busy[direction] += 1
        if not busy and threading.get_ident() == self.loop_ident and self._quick(task):
            self._inline.append(item)  # runs before the loop reads another message
            return
        with self._lock:
            self._queued[direction] += 1
        future = self.executors[direction].submit(self._run, item, queued=True)
        with self._lock:
            self._pending[future] = item
        future.add_done_callback(self._forget)

    def _quick(self, task: Any) -> bool:
        """Small swaps, and lookups where the store answers from memory: microseconds."""
        if isinstance(task, t.Lookup):
            storage = self.resources.storage
            return storage is not None and storage.quick_lookups
        return isinstance(task, INLINE_TASKS) and len(task.device_block_ids) <= INLINE_MAX_BLOCKS

    def run_inline(self) -> None:
        """The small swaps admitted on the loop thread, run there now."""
        while self._inline:
            self._run(self._inline.pop(0), queued=False)

    def queue_depths(self) -> dict[str, int]:
        """Tasks per direction submitted and not yet started."""
        with self._lock:
            return {d.value: self._queued[d] for d in t.Direction}

    def cancel(self, item: Item, why: str) -> None:
        peer, task = item[0], item[1]
        cancelled = t.Result(
            task_id=task.task_id, status=t.Status.CANCELLED, message=why, rank=self.rank
        )
        self._send(peer, t.encode(cancelled))

    def shutdown(self) -> None:
        """Let running tasks finish; answer every queued one ``cancelled``."""
        with self._lock:
            queued = dict(self._pending)  # cancelled futures leave _pending as they cancel
        for executor in self.executors.values():
            executor.shutdown(wait=False, cancel_futures=True)
        for future, item in queued.items():
            if future.cancelled():
                self.cancel(item, "worker shut down before the task ran")
                self.gate.done(item)
        for executor in self.executors.values():
            executor.shutdown(wait=True)

    def shed_queued_saves(self) -> int:
        """(The loop thread, each turn.) While the running save is blocked on a slow store,
        answer the saves queued behind it ``cancelled``: each would hold its request's blocks
        in the engine for the whole queue (``kvtier.worker.save_watch``). Returns how many."""
        if not self._queued[t.Direction.SAVE]:
            return 0
        blocked = self.save_watch.slow_store()
        if not blocked:
            return 0
        with self._lock:
            queued = [(f, item) for f, item in self._pending.items() if isinstance(item[1], t.Save)]
        why = (
            f"not written: queued behind a save blocked on the store for {blocked:.1f} s (a slow "
            "store); answered now so that the engine frees its blocks"
        )
        shed = 0
        for future, item in queued:
            if not future.cancel():  # running or done: it answers itself
                continue
            with self._lock:
                self._queued[t.Direction.SAVE] -= 1
                self._busy[t.Direction.SAVE] -= 1
            self.gate.done(item)
            self.counters.task("save", t.Status.CANCELLED.value, 0, 0.0, self._metrics())
            self.cancel(item, why)
            shed += 1
        if shed:
            log.info("rank %d: %d queued save(s) answered cancelled: %s", self.rank, shed, why)
        return shed

    def _forget(self, future: Future) -> None:
        with self._lock:
            self._pending.pop(future, None)

    def _run(self, item: Item, queued: bool) -> None:
        """``queued``: it waited in an executor's queue (inline runs never count as queued)."""
        peer, task, keys, until = item
        direction = t.DIRECTIONS[type(task)]
        if queued:
            with self._lock:
                self._queued[direction] -= 1
        saving = direction is t.Direction.SAVE
        if saving:
            blocks = len(task.device_block_ids)
            self.save_watch.started(blocks * self.resources.config.spec.block_bytes, blocks)
        # A storage transfer's waits for a core (schedstat, ~10 us a reading: not for swaps and
        # lookups of tens of microseconds): on a busy machine, time that is not the store's.
        waited = core_wait_s() if isinstance(task, STORAGE_TASKS) and not saving else None
        start, cpu_wait_s = time.perf_counter(), 0.0
        try:
            outcome = self._outcome(task, keys, until)
        finally:
            if saving:
                cpu_wait_s = self.save_watch.finished()
            elif waited is not None:
                cpu_wait_s = max(0.0, (core_wait_s() or waited) - waited)
            with self._lock:
                self._busy[direction] -= 1
            self.gate.done(item)
        seconds = time.perf_counter() - start
        self._account(task, outcome, seconds, cpu_wait_s)
        removed, all_removed = (
            self._removals(task, keys, outcome) if isinstance(task, STORAGE_TASKS) else ([], False)
        )
        result = t.Result(
            task_id=task.task_id,
            status=outcome.status,
            blocks=outcome.blocks,
            count=outcome.count,
            bytes_moved=outcome.bytes_moved,
            seconds=seconds,
            cpu_wait_s=min(cpu_wait_s, seconds),
            message=outcome.message,
            rank=self.rank,
            removed=removed,
            all_removed=all_removed,
            tiers=outcome.tiers,
        )
        self._send(peer, t.encode(result))

    def _removals(self, task: Any, keys: KeyScheme, outcome: Outcome) -> tuple[list[bytes], bool]:
        """What a storage task's answer tells of removed blocks (``kvtier.worker.removals``): those
        removed since the last answer, or all; and what this save stored under a version that
        was retired while it ran."""
        removed, all_removed = self.resources.removals.take()
        if keys.version != self.resources.keys.version and isinstance(task, SAVES):
            removed += task.block_hashes[: len(outcome.blocks)]
        if len(removed) > t.MAX_IDS_PER_TASK:  # more than a message holds: "all", as removals
            return [], True
        return removed, all_removed

    def _outcome(self, task: Any, keys: KeyScheme, until: float) -> Outcome:
        try:
            deadline.check(until, task, "before it started")
            if self.resources.datapath is None:
                raise KvtierError("the data path is closed (sleeping)")
            return self.resources.datapath.run(task, keys, until)
        except DeadlinePassed as e:
            self._cancel_log(task.task_id, e)
            return Outcome(t.Status.CANCELLED, message=str(e))
        except KvtierError as e:
            self.counters.error(type(e).__name__, self._metrics())
            return Outcome(t.Status.ERROR, message=f"{type(e).__name__}: {e}")
        except Exception as e:  # a bug: answered, logged with its traceback, worker goes on
            log.exception("rank %d: task %d failed", self.rank, task.task_id)
            self.counters.error("internal", self._metrics())
            return Outcome(t.Status.ERROR, message=f"internal error: {type(e).__name__}: {e}")

    def _account(self, task: Any, outcome: Outcome, seconds: float, cpu_wait_s: float) -> None:
        kind = t.task_name(task)
        self.counters.task(
            kind,
            outcome.status.value,
            outcome.bytes_moved,
            seconds,
            self._metrics(),
            blocks=len(outcome.blocks),
            skipped=outcome.count,
        )
        # Storage transfers are logged like the old system did (block count, elapsed time);
        # swaps and lookups, thousands a second, only at DEBUG. Numbers go to stats().
        level = logging.DEBUG if t.DIRECTIONS[type(task)] in QUIET_DIRECTIONS else logging.INFO
        if not log.isEnabledFor(level):
            return
        log.log(
            level,
            "rank %d: %s %d -> %s, %d blocks, %d bytes in %.3f ms%s",
            self.rank,
            kind,
            task.task_id,
            outcome.status.value,
            len(outcome.blocks),
            outcome.bytes_moved,
            seconds * 1e3,
            f" ({cpu_wait_s * 1e3:.3f} ms of it waiting for a core)" if cpu_wait_s else "",
        )


def _lower_priority() -> None:
    """Thread initializer: this thread (and threads it starts) yields to the engine's."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except OSError as e:  # a container may forbid it: saves then run at normal priority
        log.debug("could not lower the save thread's priority: %s", e)
