"""``kvtier pd-proxy`` between two real HTTP servers standing in for vLLM's (the real-engine
case is ``tests/engine/test_vllm_serve.py``): what each side receives, streaming passed through,
bad input answered, a failed side handled."""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
import time

import pytest

from kvtier.ops import pd_proxy
from pd_upstream import post, proxy_between_upstreams


@pytest.fixture
def pair():
    with proxy_between_upstreams() as served:
        yield served


def test_the_producer_prefills_one_token_and_the_consumer_answers(pair) -> None:
    proxy, producer, consumer = pair
    request = {"prompt": [1, 2, 3], "max_tokens": 50, "stream": True, "stream_options": {}}
    status, body = post(proxy, "/v1/completions", json.dumps(request).encode())
    assert status == 200
    assert body == b'data: {"n": 0}\n\ndata: {"n": 1}\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
    assert producer.bodies == [{"prompt": [1, 2, 3], "max_tokens": 1, "stream": False}]
    assert consumer.bodies == [request]  # unchanged
    assert proxy.server_address[0] == "127.0.0.1"


def test_bad_input_is_answered_and_nothing_is_sent_on(pair) -> None:
    proxy, producer, consumer = pair
    assert post(proxy, "/v1/completions", b"\xff garbage")[0] == 400
    assert post(proxy, "/v1/completions", b"[1, 2]")[0] == 400
    conn = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1], timeout=10)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Length", str(pd_proxy.MAX_BODY_BYTES + 1))
    conn.endheaders()
    assert conn.getresponse().status == 413
    conn.close()
    conn = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1], timeout=10)
    conn.putrequest("POST", "/v1/completions")
    conn.putheader("Content-Length", "many")
    conn.endheaders()
    assert conn.getresponse().status == 400
    conn.close()
    assert producer.bodies == [] and consumer.bodies == []


def test_a_failed_producer_costs_the_consumer_a_recompute_not_the_request(pair) -> None:
    proxy, producer, consumer = pair
    producer.shutdown()
    producer.server_close()  # refused from now on
    status, body = post(
        proxy, "/v1/completions", json.dumps({"prompt": [4], "max_tokens": 2}).encode()
    )
    assert (status, json.loads(body)) == (200, {"from": "consumer"})
    assert proxy.counts == {"requests": 1, "prefill_failures": 1, "refused": 0}


def test_a_failed_consumer_is_a_502_that_says_so(pair) -> None:
    proxy, producer, consumer = pair
    consumer.shutdown()
    consumer.server_close()
    status, body = post(proxy, "/v1/completions", json.dumps({"prompt": [4]}).encode())
    assert status == 502 and "consumer" in json.loads(body)["error"]


def test_a_client_that_hangs_up_costs_no_traceback_and_the_proxy_serves_on(pair, capfd) -> None:
    """A client that resets its connection after its answer (as streaming clients do) made
    socketserver print a 20-line traceback per request on the proxy's stderr."""
    proxy, producer, consumer = pair
    handled = threading.Event()
    original = proxy.handle_error

    def handle_error(*args) -> None:
        original(*args)
        handled.set()

    proxy.handle_error = handle_error
    body = json.dumps({"prompt": [1], "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", proxy.server_address[1]), timeout=10) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        answer = b""
        while not answer.endswith(b"0\r\n\r\n"):  # the whole chunked answer
            answer += s.recv(65536)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
    assert handled.wait(10)
    assert "Traceback" not in capfd.readouterr().err
    status, _ = post(proxy, "/v1/completions", json.dumps({"prompt": [2]}).encode())
    assert status == 200


def _completion(proxy, timeout_s: float = 10.0) -> int:
    return post(proxy, "/v1/completions", json.dumps({"prompt": [5]}).encode(), timeout_s)[0]


@pytest.fixture
def small_proxy(monkeypatch):
    """A proxy with 4 slots, 1.5 s deadlines and 2 MiB for bodies (1 MiB a peer): the attacks
    below, quickly."""
    monkeypatch.setattr(pd_proxy, "REQUEST_DEADLINE_S", 1.5)
    monkeypatch.setattr(pd_proxy, "BODY_GRACE_S", 1.5)
    monkeypatch.setattr(pd_proxy, "MAX_BUFFERED_BYTES", 2 << 20)
    monkeypatch.setattr(pd_proxy, "PARSE_FACTOR", 1)
    with proxy_between_upstreams(max_connections=4) as (proxy, _, _):
        yield proxy


def test_idle_and_many_connections_cannot_pile_up_threads_or_hold_the_proxy(small_proxy) -> None:
    """Attack: one thread per connection, unbounded and without a timeout, let any local user
    pile up threads in the proxy with idle connections and keep every client out. Now 40 idle
    connections only displace each other: threads stay bounded, each idle one is closed, and a
    client is served while they are held."""
    proxy = small_proxy
    base = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", proxy.server_address[1])) for _ in range(40)]
    try:
        assert _completion(proxy) == 200  # served at once, not after the idle ones' deadline
        for sock in idle:  # displaced by a newer one, or cut off at the request deadline
            sock.settimeout(4 * pd_proxy.REQUEST_DEADLINE_S + 10)
            answer = sock.recv(4096)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 503 "), answer
            assert threading.active_count() <= base + 2 * proxy.max_connections
        deadline = time.monotonic() + 10
        while proxy.connections:  # a cut-off handler ends just after its peer sees the close
            assert time.monotonic() < deadline, "a cut-off connection kept its handler"
            time.sleep(0.01)
        assert _completion(proxy) == 200
    finally:
        for sock in idle:
            sock.close()


def test_trickled_headers_and_bodies_are_cut_off_at_their_deadlines(small_proxy) -> None:
    """Attack: a byte every second restarted a read timeout forever, so 4 peers held every slot
    (headers) or a body's worth of memory each (bodies)."""
    proxy = small_proxy
    stop = threading.Event()

    def trickle(head: bytes) -> None:
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", proxy.server_address[1])) as s:
                    s.sendall(head)
                    while not stop.wait(0.5):
                        s.sendall(b"x")
            except OSError:
                continue

    heads = [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"] * 2
    heads += [b"POST /v1/completions HTTP/1.1\r\nContent-Length: 900000\r\n\r\n"] * 2
    threads = [threading.Thread(target=trickle, args=(head,)) for head in heads]
    try:
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # every slot is taken by a trickler now
        start, status = time.monotonic(), None
        while status != 200:
            assert time.monotonic() - start < 4 * pd_proxy.REQUEST_DEADLINE_S, "never served"
            try:
                status = _completion(proxy, 2.0)
            except OSError:
                time.sleep(0.1)
    finally:
        stop.set()
        for thread in threads:
            thread.join()


def _whole_response(sock: socket.socket) -> bytes:
    """An HTTP response read to the end of its ``Content-Length`` body (or the peer's close)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(body) < length:
        chunk = sock.recv(4096)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_bodies_are_reserved_as_they_arrive_and_a_peer_holds_at_most_its_share(
    small_proxy,
) -> None:
    """Attack: bodies claimed by ``Content-Length`` and never sent reserved the whole claim for
    the 60 s body deadline: 8 claims of 64 MiB filled the buffer and every POST got 503. Now a
    claim over the body bound is a 413, a claim reserves nothing, bytes are reserved as they
    arrive, a peer holds at most half the buffer, and a body slower than the rate floor is cut
    off and its bytes released."""
    proxy = small_proxy
    port = proxy.server_address[1]
    huge = socket.create_connection(("127.0.0.1", port), timeout=5)
    huge.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 10000000000\r\n\r\n")
    assert huge.recv(4096).startswith(b"HTTP/1.1 413 ")
    huge.close()
    claims = []
    for _ in range(2):  # claimed, never sent: nothing is held for them
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 16000000\r\n\r\n{")
        claims.append(s)
    time.sleep(0.3)
    assert proxy.buffered_bytes <= 2
    assert _completion(proxy) == 200
    sent = socket.create_connection(("127.0.0.1", port), timeout=5)
    sent.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1048577\r\n\r\n")
    sent.sendall(b" " * (1 << 20))  # one byte more than a peer's share: refused as it arrives
    answer = _whole_response(sent)
    assert answer.startswith(b"HTTP/1.1 503 ") and b"too many bodies" in answer
    sent.close()
    deadline = time.monotonic() + 4 * (pd_proxy.BODY_GRACE_S + 16)
    while proxy.buffered_bytes:  # the claims are cut off at their deadlines
        assert time.monotonic() < deadline, "the claimed bodies were never released"
        time.sleep(0.1)
    for s in claims:
        assert s.recv(4096) == b""
        s.close()
    assert _completion(proxy) == 200


def test_only_completions_models_and_health_are_relayed(pair) -> None:
    """Attack: the proxy relayed any method and path, vLLM's ``/sleep``,
    ``/reset_prefix_cache`` and ``/v1/load_lora_adapter`` included."""
    proxy, producer, consumer = pair
    for path in ("/sleep", "/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/completions/x"):
        status, body = post(proxy, path, b"{}")
        assert status == 404 and b"serves only" in body, (path, body)
    conn = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1], timeout=10)
    for path, expected in (("/is_sleeping", 404), ("/v1/models", 200), ("/metrics", 404)):
        conn.request("GET", path)
        answer = conn.getresponse()
        answer.read()
        assert answer.status == expected, path
    conn.close()
    assert producer.bodies == [] and consumer.bodies == []


def test_a_non_loopback_host_is_warned_about() -> None:
    from kvtier.ops.pd_proxy_cli import exposure_warning

    assert exposure_warning("127.0.0.1") is None and exposure_warning("::1") is None
    assert exposure_warning("localhost") is None
    warning = exposure_warning("0.0.0.0")
    assert warning is not None and "no authentication" in warning and "--host" in warning
