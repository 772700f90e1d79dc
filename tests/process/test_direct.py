"""Direct calls (``kvtier.engine.direct``): a synchronous task on the calling thread's own
connection, with real worker processes — answered exactly once, bytes right, never a hang."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import zmq

from kvtier.errors import TaskTimeout, WorkerLost
from kvtier.transport import tasks as t
from worker_helpers import FAST, block, engine, hashes, same

SLOW_STORE = {"backend": "memory", "faults": {"latency_s": 1.5}}


def _lines(client) -> int:
    """Calling threads that have their own connection to the workers."""
    return len(client._io.direct._lines)


def _slow_lookup_in_a_thread(client) -> tuple[threading.Thread, list]:
    """A lookup under way on another thread (the slow store holds it); its one outcome, an
    answer or an exception, lands in the list. (The pause only makes it likely the call is
    waiting when the test acts; the tests hold either way.)"""
    outcome: list = []

    def call() -> None:
        try:
            outcome.append(client.lookup(hashes(1), timeout_s=60))
        except Exception as e:
            outcome.append(e)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.3)
    return thread, outcome


def test_a_call_runs_on_the_calling_threads_own_connection_and_moves_bytes(tmp_path) -> None:
    with engine(tmp_path) as (client, caches):
        client.swap_out([3], [5])
        assert _lines(client) == 1  # this thread's own connection, said hello to once
        client.swap_in([5], [7])
        assert _lines(client) == 1
        for cache in caches:
            assert same(block(cache, 3), block(cache, 7))
        stored = client.save(hashes(2), [3, 7])
        assert stored.blocks == [3, 7]
        assert client.lookup(hashes(2)) == 2

        other: list = []
        thread = threading.Thread(target=lambda: other.append(client.lookup(hashes(2))))
        thread.start()
        thread.join(30)
        assert other == [2] and _lines(client) == 2  # a second thread: a second connection


def test_answers_that_come_after_a_call_gave_up_are_dropped(tmp_path) -> None:
    with engine(tmp_path, storage=SLOW_STORE) as (client, caches):
        with pytest.raises(TaskTimeout, match=r"\(lookup\): not answered in time"):
            client.lookup(hashes(1), timeout_s=0.3)
        # The lookup's late answers (0: nothing was stored) arrive while these calls wait on
        # the same connection: the swap gets its own answer (its blocks), the save (1.5 s on
        # the slow store) its own, and the next lookup its own count, 1 — a stale answer
        # taken for it would say 0.
        swapped = client.swap_out([4], [2])
        assert swapped.status is t.Status.OK and swapped.blocks == [4]
        assert client.save(hashes(1), [4], timeout_s=30).blocks == [4]
        assert client.lookup(hashes(1), timeout_s=30) == 1
        assert _lines(client) == 1


def test_a_call_fails_as_soon_as_a_rank_it_waits_for_is_lost(tmp_path) -> None:
    with engine(tmp_path, storage=SLOW_STORE) as (client, _):
        thread, outcome = _slow_lookup_in_a_thread(client)
        start = time.monotonic()
        os.kill(client.pids[1], signal.SIGKILL)
        thread.join(FAST["worker_timeout_s"])
        assert not thread.is_alive()
        assert isinstance(outcome[0], WorkerLost) and "rank 1" in str(outcome[0])
        assert time.monotonic() - start < FAST["worker_timeout_s"]
        with pytest.raises(WorkerLost):  # and the next call at once
            client.swap_out([1], [0])


def test_a_call_waits_its_turn_behind_tasks_in_flight(tmp_path) -> None:
    """While an asynchronous task is in flight, a call goes through the I/O thread, so a
    worker sees the tasks of one direction in the order they were submitted."""
    with engine(tmp_path, storage=SLOW_STORE) as (client, caches):
        pending = client.submit(t.Save(block_hashes=hashes(1), device_block_ids=[1]))
        answers: list = []
        thread = threading.Thread(target=lambda: answers.append(client.swap_out([6], [3])))
        thread.start()
        thread.join(30)
        assert answers[0].blocks == [6]
        assert _lines(client) == 0  # the call took the I/O thread's path
        assert pending.result(30).blocks == [1]
        client.swap_out([6], [3])
        assert _lines(client) == 1  # nothing in flight now: its own connection


def test_closing_the_client_ends_a_call_under_way(tmp_path) -> None:
    with engine(tmp_path, storage=SLOW_STORE) as (client, _):
        thread, outcome = _slow_lookup_in_a_thread(client)
        start = time.monotonic()
        client.close()
        thread.join(10)
        assert not thread.is_alive()
        assert time.monotonic() - start < 10
        # The lookup was answered before close ended the workers (they finish what they
        # hold), or it failed naming the closed client: either way exactly one outcome.
        assert len(outcome) == 1
        assert outcome[0] == 0 or isinstance(outcome[0], WorkerLost)


def test_a_heartbeat_is_echoed_with_its_own_stamp(tmp_path) -> None:
    """A ping waits for its own echo: a periodic heartbeat's answer cannot complete it."""
    with engine(tmp_path, world_size=1) as (client, _):
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        try:
            sock.connect(client._ranks[0].endpoint)
            sock.send(t.encode(t.Hello(protocol_version=t.PROTOCOL_VERSION, client_id="probe")))
            assert sock.poll(10_000) and isinstance(t.decode_frame(sock.recv())[0], t.Welcome)
            sock.send(t.encode(t.Heartbeat(sent_at=-42.0)))
            assert sock.poll(10_000)
            assert t.decode_frame(sock.recv()) == [t.Heartbeat(sent_at=-42.0)]
        finally:
            sock.close(linger=0)
            context.term()
        assert client.ping() > 0


def test_threads_past_the_bound_go_through_the_io_thread(tmp_path, monkeypatch) -> None:
    """A thread made per call must not pile up sockets (and peers at every worker)."""
    import kvtier.engine.direct

    monkeypatch.setattr(kvtier.engine.direct, "MAX_LINES", 2)
    with engine(tmp_path, world_size=1) as (client, _):
        answers: list = []
        for _ in range(4):
            thread = threading.Thread(target=lambda: answers.append(client.swap_out([2], [1])))
            thread.start()
            thread.join(30)
        assert [a.blocks for a in answers] == [[2]] * 4
        assert _lines(client) == 2
