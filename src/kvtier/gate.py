"""The admission gate of a worker: RUNNING / PAUSED / SLEEPING, held tasks, in-flight count."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
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


# Tasks admitted and not finished, held ones included: a bound on a worker's memory whatever
# a client sends (a well-behaved engine waits on far fewer).
MAX_PENDING_TASKS = 100_000


class Gate:
    """Admits data tasks: runs them now, holds them (while paused), or refuses them.

    ``admit`` and ``resume`` submit under one lock, so held tasks run before any task that
    arrives after ``resume``: FIFO holds across a pause. Thread-safe.
    """

    def __init__(self, max_pending: int = MAX_PENDING_TASKS) -> None:
        self.max_pending = max_pending
        self._cond = threading.Condition()
        self.state = WorkerState.RUNNING
        self.in_flight = 0
        self._held: deque[Any] = deque()

    def admit(self, item: Any, submit: Callable[[Any], None]) -> Refusal | None:
        with self._cond:
            if self.state is WorkerState.STOPPING:
                return Refusal.STOPPING
            if self.state is WorkerState.SLEEPING:
                return Refusal.SLEEPING
            if self.in_flight + len(self._held) >= self.max_pending:
                return Refusal.FULL
            if self.state in HOLDING_STATES:
                self._held.append(item)
                return None
            self.in_flight += 1
            submit(item)
            return None

    def done(self, count: int = 1) -> None:
        with self._cond:
            self.in_flight -= count
            self._cond.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.in_flight == 0, timeout_s)

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
        with self._cond:
            held = list(self._held)
            self._held.clear()
            return held

    @property
    def held(self) -> int:
        with self._cond:
            return len(self._held)
