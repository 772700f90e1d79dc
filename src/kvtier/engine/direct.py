"""Direct calls: a synchronous task sent and answered on the calling thread's own connection.

Through the I/O thread (``kvtier.engine.supervisor``) a task costs two thread hand-offs each way —
caller to I/O thread to socket, socket to I/O thread to caller — each a wake-up and a GIL
hand-over, together several times ZeroMQ's own round trip. A thread that waits for its answer
anyway can send and receive itself: each calling thread gets its own connection to every rank
(``Channel``, said hello to once) and waits on it, so a call costs what the transport costs.

What stays with the I/O thread: heartbeats and each rank's health (a direct call fails with
``WorkerLost`` as soon as the I/O thread loses a rank it waits for, and with ``TaskTimeout`` at
its deadline: never a hang), and every asynchronous task. A direct call is taken only while no
asynchronous task is in flight (``Supervisor.call`` looks), so tasks of one direction still reach a
worker in the order they were submitted. Answers that come after their call gave up (timed out,
interrupted) are dropped by task id. A thread whose hello was not accepted in time goes through
the I/O thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from kvtier.engine.fanin import aggregate
from kvtier.engine.ranks import Rank
from kvtier.errors import TaskTimeout, WorkerLost
from kvtier.transport import tasks as t
from kvtier.transport.base import Channel, ClientTransport

log = logging.getLogger(__name__)

# A direct call looks at its ranks' health (kept by the I/O thread) this often while it waits.
CHECK_INTERVAL_S = 0.05
# A new thread's hello must be welcomed by every rank within this; if not, that thread's calls
# go through the I/O thread (a rank that is slow now is the I/O thread's to judge).
HELLO_WAIT_S = 5.0
# Calling threads that get their own connection; later ones go through the I/O thread (an
# engine calls from a few long-lived threads; one making a thread per call must not pile up
# sockets, nor peers at every worker).
MAX_LINES = 32
CLOSE_WAIT_S = 1.0  # close() waits this long for a call under way to notice and leave


class _Line:
    """A calling thread's channel; its lock is held for the length of a call."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.lock = threading.Lock()


UNAVAILABLE = object()  # a thread whose channel could not be opened or welcomed


class DirectCalls:
    """The channels of one client's calling threads."""

    def __init__(self, ranks: Sequence[Rank], transport: ClientTransport, hello: bytes) -> None:
        """``ranks``: the client's, whose health its I/O thread keeps; ``transport``: where
        channels come from; ``hello``: the client's encoded hello, said on each channel."""
        self._ranks = list(ranks)
        self._transport = transport
        self._hello = hello
        self._local = threading.local()
        self._lock = threading.Lock()
        self._lines: list[_Line] = []
        self._closed = False

    def call(self, task: Any, deadline: float) -> t.Result | None:
        """``task``'s aggregated answer, on this thread; None when this thread has no channel
        (send it through the I/O thread). Raises WorkerLost or TaskTimeout as a future would."""
        line = self._line()
        if line is None:
            return None
        payload = t.encode(task)
        with line.lock:  # close() waits for it: a socket is closed only between calls
            self._check_ranks(task)
            for r in self._ranks:
                line.channel.send(r.position, payload)
            results: dict[int, t.Result] = {}
            for r in self._ranks:  # each rank's answer in turn; the others' wait in their sockets
                while r.position not in results:
                    for message in self._receive(line.channel, r.position, task, deadline):
                        if isinstance(message, t.Result) and message.task_id == task.task_id:
                            results[r.position] = message
        return aggregate(task, results)

    def close(self) -> None:
        """Close every thread's channel (the client is stopping); a call under way notices
        within ``CHECK_INTERVAL_S`` and fails with WorkerLost."""
        with self._lock:
            self._closed = True
            lines, self._lines = self._lines, []
        for line in lines:
            if line.lock.acquire(timeout=CLOSE_WAIT_S):
                line.channel.close()
                line.lock.release()
            else:  # a thread stuck in a call: its socket is left to the process's end
                log.warning("client: a calling thread did not leave its call; channel left open")

    # ---- one call ---------------------------------------------------------------------------

    def _receive(self, channel: Channel, position: int, task: Any, deadline: float) -> list[Any]:
        """The messages of ``position``'s next frame; none when ``CHECK_INTERVAL_S`` passed
        without one, after looking at every rank's health (a lost one raises WorkerLost)."""
        now = time.monotonic()
        if now > deadline:
            raise TaskTimeout(f"task {task.task_id} ({t.task_name(task)}): not answered in time")
        payload = channel.receive(position, min(CHECK_INTERVAL_S, deadline - now))
        if payload is None:
            self._check_ranks(task)
            return []
        return _messages(payload)

    def _check_ranks(self, task: Any) -> None:
        for r in self._ranks:
            if r.lost:
                raise WorkerLost(
                    f"rank {r.position}: {r.lost} (task {task.task_id} {t.task_name(task)})"
                )
        if self._closed:
            raise WorkerLost("client closed")

    # ---- channels ---------------------------------------------------------------------------

    def _line(self) -> _Line | None:
        line = getattr(self._local, "line", None)
        if line is None:
            line = self._local.line = self._open() or UNAVAILABLE
        return line if isinstance(line, _Line) else None

    def _open(self) -> _Line | None:
        with self._lock:
            if self._closed or len(self._lines) >= MAX_LINES:
                return None
            channel = self._transport.channel()
            if channel is None:
                return None
            line = _Line(channel)
            self._lines.append(line)
        with line.lock:
            if self._welcomed(channel):
                return line
        log.info("client: a calling thread's channel was not welcomed by every rank in time")
        return None

    def _welcomed(self, channel: Channel) -> bool:
        for r in self._ranks:
            channel.send(r.position, self._hello)
        deadline = time.monotonic() + HELLO_WAIT_S
        for r in self._ranks:
            welcomed = False
            while not welcomed:
                left = deadline - time.monotonic()
                payload = channel.receive(r.position, left) if left > 0 else None
                if payload is None:
                    return False
                for message in _messages(payload):
                    if isinstance(message, t.Welcome):
                        if not message.accepted:
                            return False
                        welcomed = True
        return True


def _messages(payload: bytes) -> list[Any]:
    """The messages in a frame: one, or a bundle's (None for one that is malformed)."""
    message = _decode(payload)
    if not isinstance(message, t.Bundle):
        return [message]
    items = [_decode(bytes(item)) for item in message.items]
    return [None if isinstance(m, t.Bundle) else m for m in items]  # never nested


def _decode(payload: bytes) -> Any:
    try:
        return t.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        log.warning("client: a worker sent a malformed message: %s", str(e)[:200])
        return None
