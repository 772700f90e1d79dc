"""Supervisor: a Client's I/O thread — the transport, the hellos, the heartbeats, each rank's
health, and every task in flight until it is answered exactly once.

It sends tasks and heartbeats, receives results, and watches the workers. A task's future
resolves when every rank it waits for has answered: blocks are the shortest prefix over ranks,
the status the worst. It fails with ``WorkerLost`` when a rank is lost (its process exits, its
heartbeats stop for ``worker_timeout_s``, its peer fails to authenticate: ``Rank.check``), and
with ``TaskTimeout`` at its deadline — never a hang. The ``ready`` condition is notified when a
rank is welcomed or lost (``Client.start`` waits on it).

A busy machine stalls processes for seconds. Silence is counted only while this thread runs
(after a stall of its own, every rank gets a fresh ``worker_timeout_s``), and a rank lost by
silence alone is sent hellos again: when the same worker process answers, it is restored and
takes tasks again (the tasks failed meanwhile were recomputed by the engine). A rank whose
process exited, or whose peer failed to authenticate, stays lost.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvtier.engine.direct import DirectCalls
from kvtier.engine.fanin import TaskFuture, aggregate
from kvtier.engine.ranks import Rank
from kvtier.errors import ProtocolMismatch, TaskTimeout, WorkerError, WorkerLost
from kvtier.transport import tasks as t
from kvtier.transport.auth import CurveKeys
from kvtier.transport.connect import client_transport

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.05
# Health, deadlines, hellos and heartbeats are looked at this often, not on every turn: under
# load a turn comes every few microseconds, and each look polls every worker process.
CHECK_INTERVAL_S = 0.01
HELLO_RESEND_S = 1.0  # until welcomed: a worker that binds late still gets one
# This thread not running for longer than this (a stalled process) is a stall of its own: the
# workers' silence meanwhile is not held against them. Turns are POLL_INTERVAL_S apart.
STALL_S = 1.0


@dataclass
class Pending:
    task: Any
    future: TaskFuture
    deadline: float
    results: dict[int, t.Result] = field(default_factory=dict)
    expected: set[int] | None = None  # positions that must answer (None: all)


class Supervisor:
    def __init__(
        self,
        ranks: Sequence[Rank],
        hello: t.Hello,
        curve: CurveKeys | None,
        worker_timeout_s: float,
        heartbeat_interval_s: float,
    ) -> None:
        self.ranks = list(ranks)
        self.ready = threading.Condition()
        self.closing = False
        self._hello = t.encode(hello)
        self._curve = curve
        self._worker_timeout_s = worker_timeout_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._pending: dict[int, Pending] = {}
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_asked = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ping: tuple[float, threading.Event, set[int]] | None = None
        self._ping_stamps = itertools.count(1)

    @property
    def running(self) -> bool:
        return self._thread is not None

    def open(self) -> None:
        self.transport = client_transport([r.endpoint for r in self.ranks], self._curve)
        self.transport.open()
        self.direct = DirectCalls(self.ranks, self.transport, self._hello)
        self._thread = threading.Thread(target=self._loop, name="kvtier-client", daemon=True)
        self._thread.start()

    def wait_settled(self, timeout_s: float) -> bool:
        """Until every rank is welcomed or one is lost; False at the timeout."""
        with self.ready:
            return self.ready.wait_for(
                lambda: all(r.welcomed for r in self.ranks) or any(r.lost for r in self.ranks),
                timeout_s,
            )

    def send(self, task: Any, future: TaskFuture, deadline: float, expected=None) -> None:
        """Track ``task`` until every rank of ``expected`` (None: all) answered, then send it;
        it fails at once when one of them is lost already (a shutdown still reaches the rest)."""
        with self._lock:
            lost = [
                r for r in self.ranks if r.lost and (expected is None or r.position in expected)
            ]
            if lost or self._thread is None:
                why = f"rank {lost[0].position}: {lost[0].lost}" if lost else "client is closed"
                future.set_exception(WorkerLost(why))
                return
            self._pending[task.task_id] = Pending(task, future, deadline, expected=expected)
        self._send_all(task)

    def call(self, task: Any, deadline: float) -> t.Result | None:
        """``task`` sent and answered on the calling thread (``kvtier.engine.direct``) when nothing
        is in flight through this thread; None: use ``send``."""
        with self._lock:
            if self._pending or self._thread is None:
                return None
        return self.direct.call(task, deadline)

    def ping(self, timeout_s: float) -> bool:
        """A heartbeat to every rank; True when all echoed it within ``timeout_s`` (the
        periodic heartbeats' answers carry other stamps: they do not count)."""
        event = threading.Event()
        stamp = -float(next(self._ping_stamps))  # periodic beats carry the time (> 0)
        with self._lock:
            self._ping = (stamp, event, set(range(len(self.ranks))))
        self._send_all(t.Heartbeat(sent_at=stamp))
        return event.wait(timeout_s)

    def stop(self) -> None:
        """End the thread; every task still waiting fails with WorkerLost."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(5)
        self._thread = None
        with self._lock:
            leftover = list(self._pending.values())
            self._pending.clear()
        for p in leftover:
            p.future.set_exception(WorkerLost("client closed"))
        self.direct.close()
        self.transport.close()

    # ---- the thread -------------------------------------------------------------------------

    def _send_all(self, message: Any) -> None:
        self._outbox.put(t.encode(message))
        # One wake until the thread turns: each costs a message and a switch of threads, and
        # the thread sends everything queued when it turns. It clears the flag before it empties
        # the outbox, so a message queued after that wakes it again (a spare wake is harmless).
        if not self._wake_asked:
            self._wake_asked = True
            self.transport.wake()

    def _loop(self) -> None:
        next_beat = last_turn = next_check = time.monotonic()
        while not self._stop.is_set():
            received = self.transport.receive(POLL_INTERVAL_S)
            self._flush_outbox()
            for position, payload in received:
                self._receive(self.ranks[position], payload)
            now = time.monotonic()
            if now < next_check:
                continue  # a busy turn (answers, sends): the checks below wait their time
            next_check = now + CHECK_INTERVAL_S
            if now - last_turn > STALL_S:
                self._stalled(now, now - last_turn)
                next_beat = now
            last_turn = now
            if now >= next_beat:
                beat = t.encode(t.Heartbeat(sent_at=time.time()))
                for r in self.ranks:
                    if r.welcomed and not r.lost:
                        self.transport.send(r.position, beat)
                next_beat = now + self._heartbeat_interval_s
            self._say_hello(now)
            self._check_health(now)

    def _stalled(self, now: float, seconds: float) -> None:
        """This thread did not run for ``seconds``: nothing was sent, so nothing was answered.
        Said at WARNING only when the silence would have lost a rank."""
        log.log(
            logging.WARNING if seconds > self._worker_timeout_s else logging.DEBUG,
            "client: this process's kvtier I/O thread did not run for %.1f s (an overloaded "
            "machine?): the workers' silence meanwhile is not counted",
            seconds,
        )
        for r in self.ranks:
            r.last_heard = max(r.last_heard, now)

    def _say_hello(self, now: float) -> None:
        """Until welcomed; and to a rank lost by silence alone, until it answers again."""
        for r in self.ranks:
            waiting = not r.welcomed and not r.lost
            if (waiting or (r.lost and r.recoverable)) and now - r.last_hello >= HELLO_RESEND_S:
                self.transport.send(r.position, self._hello)
                r.last_hello = now

    def _flush_outbox(self) -> None:
        """Everything queued, to every live rank: bundled (``t.bundle``) when several wait."""
        self._wake_asked = False
        payloads = []
        while True:
            try:
                payloads.append(self._outbox.get_nowait())
            except queue.Empty:
                break
        for frame in t.bundle(payloads):
            for r in self.ranks:
                if not r.lost:
                    self.transport.send(r.position, frame)

    def _receive(self, r: Rank, payload: bytes, bundled: bool = False) -> None:
        try:
            message = t.decode(payload)
            if isinstance(message, t.Bundle) and bundled:
                raise msgspec.ValidationError("a bundle inside a bundle")
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            log.warning("client: rank %d sent a malformed message: %s", r.position, str(e)[:200])
            return
        r.last_heard = time.monotonic()
        if isinstance(message, t.Bundle):
            for item in message.items:
                self._receive(r, bytes(item), bundled=True)
        elif isinstance(message, t.Result):
            self._on_result(r, message)
        elif isinstance(message, t.Welcome):
            if r.lost:
                if message.accepted and r.may_come_back(message.pid):
                    self._restore(r)
                return
            with self.ready:
                if message.accepted:
                    r.welcomed = True
                    r.pid = r.pid or message.pid
                else:
                    r.lost, r.lost_error = message.message, ProtocolMismatch
                self.ready.notify_all()
        elif isinstance(message, t.Heartbeat):
            self._on_heartbeat(r, message)

    def _on_heartbeat(self, r: Rank, beat: t.Heartbeat) -> None:
        r.save_blocked = (beat.save_blocks, beat.save_blocked_s, time.monotonic())
        ping = self._ping
        if ping is not None and beat.sent_at == ping[0]:
            _, event, waiting = ping
            waiting.discard(r.position)
            if not waiting:
                event.set()

    def _on_result(self, r: Rank, result: t.Result) -> None:
        with self._lock:
            pending = self._pending.get(result.task_id)
            if pending is None:
                return  # answered already (timed out, or a worker was lost)
            pending.results[r.position] = result
            expected = pending.expected or range(len(self.ranks))
            if any(p not in pending.results for p in expected):
                return
            del self._pending[result.task_id]
        pending.future.per_rank = dict(pending.results)
        pending.future.set_result(aggregate(pending.task, pending.results))

    def _check_health(self, now: float) -> None:
        for r in self.ranks:
            failed = self.transport.failed_handshakes(r.position)
            loss = r.check(now, failed, self._worker_timeout_s)
            if loss is not None:
                self._lose(r, *loss)
        with self._lock:
            expired = [p for p in self._pending.values() if now > p.deadline]
            for p in expired:
                del self._pending[p.task.task_id]
        for p in expired:
            missing = sorted(set(p.expected or range(len(self.ranks))) - set(p.results))
            p.future.set_exception(
                TaskTimeout(
                    f"task {p.task.task_id} ({t.task_name(p.task)}): ranks {missing} "
                    "did not answer in time"
                )
            )

    def _lose(
        self, r: Rank, why: str, error: type[WorkerError] = WorkerError, recoverable: bool = False
    ) -> None:
        """Mark a rank lost and fail every task that waits for it (also while closing)."""
        with self.ready:
            r.lost, r.lost_error = why, error
            r.recoverable, r.lost_at = recoverable, time.monotonic()
            self.ready.notify_all()
        if not r.welcomed:
            return  # start() reports it, with the worker's log
        if not self.closing:
            again = " (it is taken back if it answers again)" if recoverable else ""
            log.error("client: rank %d lost: %s%s", r.position, why, again)
        with self._lock:
            failed = [
                p for p in self._pending.values() if r.position in (p.expected or [r.position])
            ]
            for p in failed:
                del self._pending[p.task.task_id]
        for p in failed:
            p.future.set_exception(
                WorkerLost(
                    f"rank {r.position}: {why} (task {p.task.task_id} {t.task_name(p.task)})"
                )
            )

    def _restore(self, r: Rank) -> None:
        """A rank lost by silence answered a hello again from the same process: it takes
        tasks again (those sent while it was lost have failed already)."""
        now = time.monotonic()
        with self.ready:
            r.lost, r.lost_error, r.recoverable = "", WorkerError, False
            r.last_heard = now
            self.ready.notify_all()
        if not self.closing:
            log.warning(
                "client: rank %d answers again after %.1f s: restored", r.position, now - r.lost_at
            )
