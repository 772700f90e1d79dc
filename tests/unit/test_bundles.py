"""Bundles: several messages in one frame, each handled and answered as if it came alone; the
client bundles what queued up, a worker what it answered in one turn."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest

from conftest import fill_random
from kvtier.engine import supervisor
from kvtier.engine.client import Client
from kvtier.transport import tasks as t
from kvtier.transport.local import LocalClient
from kvtier.transport.turns import TurnSender
from worker_helpers import hashes, local_worker


@pytest.fixture(name="worker")
def worker_fixture():
    worker = local_worker("bn", num_host_blocks=8, staging_blocks=2)
    yield worker
    worker.close()


def test_frames_keep_the_order_and_stay_within_the_bounds() -> None:
    small = [t.encode(t.Heartbeat(sent_at=float(i))) for i in range(600)]
    frames = t.bundle(small)
    assert len(frames) == 3  # 256 + 256 + 88
    assert [m for f in frames for m in t.decode_frame(f)] == [t.decode(p) for p in small]
    big = [t.encode(t.Result(task_id=i, status=t.Status.OK, message="x" * 1000)) for i in range(9)]
    huge = [t.encode(t.Lookup(task_id=i, block_hashes=[bytes(64)] * 20_000)) for i in range(5)]
    frames = t.bundle(big + huge)
    assert all(len(f) <= t.MAX_MESSAGE_BYTES for f in frames) and len(frames) > 1
    decoded = [m.task_id for f in frames for m in t.decode_frame(f)]
    assert decoded == list(range(9)) + list(range(5))
    alone = t.encode(t.Heartbeat(sent_at=1.0))
    assert t.bundle([alone]) == [alone] and t.bundle([]) == []


def test_a_bundle_inside_a_bundle_or_past_its_bound_is_refused() -> None:
    inner = t.bundle([t.encode(t.Heartbeat(sent_at=1.0))] * 2)[0]
    outer = t.encode(t.Bundle(items=[msgspec.Raw(inner), msgspec.Raw(inner)]))
    with pytest.raises(msgspec.ValidationError, match="a bundle inside a bundle"):
        t.decode_frame(outer)
    beat = msgspec.Raw(t.encode(t.Heartbeat(sent_at=1.0)))
    with pytest.raises(msgspec.ValidationError):
        t.decode(t.encode(t.Bundle(items=[beat] * (t.MAX_BUNDLE_ITEMS + 1))))


def _collect(peer: LocalClient, want: int, timeout_s: float = 10.0) -> tuple[list, int]:
    """Messages from the worker until ``want`` arrived, and how many frames carried them."""
    messages, frames = [], 0
    deadline = time.monotonic() + timeout_s
    while len(messages) < want and time.monotonic() < deadline:
        for _, payload in peer.receive(0.1):
            frames += 1
            messages += t.decode_frame(payload)
    return messages, frames


def test_every_message_of_a_bundle_is_answered_once_and_the_answers_leave_bundled(worker):
    client_hashes = hashes(4)
    with Client.connect([worker.config.endpoint], start_timeout_s=10) as client:
        fill_random(worker.resources.device_cache, 5)
        client.save(client_hashes, [1, 2, 3, 4])
    peer = LocalClient([worker.config.endpoint])
    peer.open()
    peer.send(0, t.encode(t.Hello(protocol_version=t.PROTOCOL_VERSION, client_id="bundler")))
    assert _collect(peer, 1)[0][0].accepted
    nested = t.bundle([t.encode(t.Heartbeat(sent_at=2.0))] * 2)[0]
    items = [t.encode(t.Lookup(task_id=i, block_hashes=client_hashes)) for i in range(1, 21)]
    items += [
        t.encode(t.SwapOut(task_id=21, device_block_ids=[1], host_block_ids=[0])),
        msgspec.msgpack.encode({"type": "lookup", "task_id": 22, "block_hashes": 3}),
        nested,  # a bundle inside: malformed, no task id to answer
        t.encode(t.Heartbeat(sent_at=-7.0)),
        t.encode(t.SwapOut(task_id=23, device_block_ids=[999], host_block_ids=[0])),
    ]
    peer.send(0, t.encode(t.Bundle(items=[msgspec.Raw(p) for p in items])))
    messages, frames = _collect(peer, 24)
    results = [m for m in messages if isinstance(m, t.Result)]
    assert sorted(r.task_id for r in results) == list(range(1, 24))  # each exactly once
    by_id = {r.task_id: r for r in results}
    assert all(by_id[i].count == 4 for i in range(1, 21))
    assert by_id[21].status is t.Status.OK
    assert by_id[22].status is t.Status.ERROR and "malformed task" in by_id[22].message
    assert by_id[23].status is t.Status.ERROR and "999" in by_id[23].message
    assert [m for m in messages if isinstance(m, t.Heartbeat)] == [t.Heartbeat(sent_at=-7.0)]
    lookups = [r.task_id for r in results if r.task_id <= 20]
    assert lookups == sorted(lookups)  # answered in the order they came
    assert frames < len(messages)  # answered in one turn: bundled
    assert worker.stats()["errors"]["malformed"] == 2
    time.sleep(0.2)
    assert _collect(peer, 1, timeout_s=0.3)[0] == []  # nothing answered twice
    peer.close()


def test_a_client_bundles_what_queues_up_and_answers_every_future(worker, monkeypatch):
    sizes: list[int] = []
    bundle = t.bundle

    def counted(payloads: list[bytes]) -> list[bytes]:
        sizes.append(len(payloads))
        return bundle(payloads)

    monkeypatch.setattr(supervisor.t, "bundle", counted)
    client_hashes = hashes(3)
    with Client.connect([worker.config.endpoint], start_timeout_s=10) as client:
        fill_random(worker.resources.device_cache, 5)
        client.save(client_hashes, [1, 2, 3])
        futures = [client.submit(t.Lookup(block_hashes=client_hashes)) for _ in range(300)]
        futures += [client.submit(t.Lookup(block_hashes=hashes(2, seed=9))) for _ in range(50)]
        results = [f.result(30) for f in futures]
    assert [r.count for r in results] == [3] * 300 + [0] * 50
    assert sum(sizes) >= 350 and max(sizes) > 1  # several tasks went in one frame


def test_a_turn_holds_the_loop_threads_sends_up_to_a_bound_and_no_other_thread_s() -> None:
    sent: list[tuple[bytes, list]] = []
    out = TurnSender(lambda peer, frame: sent.append((peer, t.decode_frame(frame))), most_held=3)
    beats = [t.encode(t.Heartbeat(sent_at=float(i))) for i in range(8)]
    out.start()
    for payload in beats[:4]:
        out.send(b"a", payload)
    out.send(b"b", beats[4])
    assert [(p, len(m)) for p, m in sent] == [(b"a", 3)]  # the bound reached: gone at once
    other = threading.Thread(target=out.send, args=(b"c", beats[5]))
    other.start()
    other.join()
    assert sent[-1][0] == b"c"  # another thread's send is never held
    out.flush()
    assert [(p, len(m)) for p, m in sent[2:]] == [(b"a", 1), (b"b", 1)]
    out.send(b"a", beats[6])
    out.stop()  # flushes, and holds nothing from now on
    out.send(b"a", beats[7])
    assert [m[0].sent_at for _, m in sent[-2:]] == [6.0, 7.0]
