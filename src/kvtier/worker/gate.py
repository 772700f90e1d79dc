"""The admission gate of a worker: RUNNING / PAUSED / SLEEPING, held tasks, in-flight count."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable
from enum import Enum
from typing import Any


class WorkerState(str, Enum):
    RUNNING = "running"
    PAUSED = "paused"
    SLEEPING = "sleeping"
    WAKING = "waking"  # a wakeup is under way: new data tasks are held until it ends
    STOPPING = "stopping"


HOLDING_STATES = (WorkerState.PAUSED, WorkerState.WAKING)


class Refusal(str, Enum):
    SLEEPING = "worker is sleeping: wake it up first"
    STOPPING = "worker is shutting down"
    FULL = "worker queue is full: too many tasks waiting; retry later"
    OWNER_FULL = (
        "this client has too much work queued (block ids of tasks admitted and not finished): "
        "wait for answers before sending more"
    )


# Tasks admitted and not finished, held ones included: a bound on a worker's memory whatever
# a client sends (a well-behaved engine waits on far fewer).
MAX_PENDING_TASKS = 100_000
# Block ids (and hashes) of one client's tasks admitted and not finished: what a client can make
# a worker hold in memory (~40-70 MiB of Python lists at this bound). An engine's step carries a
# few thousand; a paused worker holding a whole batch of saves stays far below.
MAX_QUEUED_IDS_PER_OWNER = 1 << 20


def _unweighed(item: Any) -> tuple[Hashable, int]:
    return None, 0


class Gate:
    """Admits data tasks: runs them now, holds them (while paused), or refuses them.

    ``admit`` and ``resume`` submit under one lock, so held tasks run before any task that
    arrives after ``resume``: FIFO holds across a pause. Thread-safe.
    """

    def __init__(
        self,
        max_pending: int = MAX_PENDING_TASKS,
        *,
        weigh: Callable[[Any], tuple[Hashable, int]] = _unweighed,
        max_ids_per_owner: int = MAX_QUEUED_IDS_PER_OWNER,
    ) -> None:
        """``weigh(item)`` names an item's owner (the peer) and its size in ids; each owner may
        have at most ``max_ids_per_owner`` ids admitted and not yet ``done``."""
        self.max_pending = max_pending
        self.max_ids_per_owner = max_ids_per_owner
        self._weigh = weigh
        # Taken directly on the per-task path (``with self._lock``: no Python-level __enter__);
        # the condition over it serves wait_idle.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self.state = WorkerState.RUNNING
        self.in_flight = 0
        self._held: deque[Any] = deque()
        self._queued_ids: dict[Hashable, int] = {}  # owner -> ids admitted, not done (> 0)
        self._idle_waiters = 0  # threads in wait_idle: only they need a notify

    def admit(self, item: Any, submit: Callable[[Any], None]) -> Refusal | None:
        owner, ids = self._weigh(item)
        with self._lock:
            state = self.state
            if state is WorkerState.STOPPING:
                return Refusal.STOPPING
            if state is WorkerState.SLEEPING:
                return Refusal.SLEEPING
            if self.in_flight + len(self._held) >= self.max_pending:
                return Refusal.FULL
            queued = self._queued_ids.get(owner, 0) + ids
            if ids and queued > self.max_ids_per_owner:
                return Refusal.OWNER_FULL
            if queued:
                self._queued_ids[owner] = queued
            if state in HOLDING_STATES:
                self._held.append(item)
                return None
            self.in_flight += 1
            submit(item)
            return None

    def done(self, *items: Any) -> None:
        """``items`` (admitted, submitted) have finished or were cancelled."""
        with self._lock:
            self.in_flight -= len(items)
            self._release(items)
            if self._idle_waiters:
                self._cond.notify_all()

    def queued_ids(self, owner: Hashable) -> int:
        with self._lock:
            return self._queued_ids.get(owner, 0)

    def _release(self, items) -> None:
        for item in items:
            owner, ids = self._weigh(item)
            left = self._queued_ids.get(owner, 0) - ids
            if left > 0:
                self._queued_ids[owner] = left
            else:
                self._queued_ids.pop(owner, None)

    def wait_idle(self, timeout_s: float) -> bool:
        with self._cond:
            self._idle_waiters += 1
            try:
                return self._cond.wait_for(lambda: self.in_flight == 0, timeout_s)
            finally:
                self._idle_waiters -= 1

    def set_state(self, state: WorkerState) -> WorkerState:
        with self._cond:
            previous, self.state = self.state, state
            return previous

    def resume(self, submit: Callable[[Any], None]) -> int:
        """RUNNING again; held tasks are submitted in arrival order. Returns how many."""
        with self._cond:
            self.state = WorkerState.RUNNING
            released = len(self._held)
            while self._held:
                self.in_flight += 1
                submit(self._held.popleft())
            return released

    def take_held(self) -> list[Any]:
        """The held items, removed from the gate (the caller answers them)."""
        with self._cond:
            held = list(self._held)
            self._held.clear()
            self._release(held)
            return held

    @property
    def held(self) -> int:
        with self._cond:
            return len(self._held)
