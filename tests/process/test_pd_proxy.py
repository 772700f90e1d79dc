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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtier.ops import pd_proxy


class Upstream(ThreadingHTTPServer):
    """Records every body; answers a completion as a server would (streamed when asked)."""

    def __init__(self, name: str) -> None:
        self.name, self.bodies = name, []
        super().__init__(("127.0.0.1", 0), _Answer)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Answer(BaseHTTPRequestHandler):
    server: Upstream

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        if body.get("stream"):
            chunks = [b'data: {"n": %d}\n\n' % i for i in range(3)] + [b"data: [DONE]\n\n"]
        else:
            chunks = [json.dumps({"from": self.server.name}).encode()]
        self.send_response(200)
        self.send_header(
            "Content-Type", "text/event-stream" if body.get("stream") else "application/json"
        )
        self.send_header("Content-Length", str(sum(map(len, chunks))))
        self.end_headers()
        for chunk in chunks:
            self.wfile.write(chunk)


@pytest.fixture
def pair():
    producer, consumer = Upstream("producer"), Upstream("consumer")
    proxy = pd_proxy.serve(producer.url, consumer.url, "127.0.0.1", 0, 10.0)
    yield proxy, producer, consumer
    for server in (proxy, producer, consumer):
        server.shutdown()
        server.server_close()


def post(proxy, path: str, body: bytes, timeout_s: float = 10.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1], timeout=timeout_s)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


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
    """A proxy with 4 slots, 1.5 s deadlines and 2 MiB for bodies: the attacks below, quickly."""
    monkeypatch.setattr(pd_proxy, "REQUEST_DEADLINE_S", 1.5)
    monkeypatch.setattr(pd_proxy, "BODY_DEADLINE_S", 1.5)
    monkeypatch.setattr(pd_proxy, "MAX_BUFFERED_BYTES", 2 << 20)
    producer, consumer = Upstream("producer"), Upstream("consumer")
    proxy = pd_proxy.serve(producer.url, consumer.url, "127.0.0.1", 0, 10.0, max_connections=4)
    yield proxy
    for server in (proxy, producer, consumer):
        server.shutdown()
        server.server_close()


def test_idle_and_many_connections_cannot_pile_up_threads_or_hold_the_proxy(small_proxy) -> None:
    """Attack: one thread per connection, unbounded and without a timeout, let any local user
    pile up threads in the proxy with idle connections and keep every client out."""
    proxy = small_proxy
    base = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", proxy.server_address[1])) for _ in range(40)]
    try:
        answers = []
        for sock in idle:  # each is refused (503) at once or cut off at the request deadline
            sock.settimeout(4 * pd_proxy.REQUEST_DEADLINE_S + 10)
            answers.append(sock.recv(4096))
            assert threading.active_count() <= base + proxy.max_connections
        refused = [a for a in answers if a]
        assert len(refused) >= 40 - 4 * proxy.max_connections, answers
        assert all(a.startswith(b"HTTP/1.1 503 ") and b"too many connections" in a for a in refused)
        assert set(answers) - set(refused) == {b""}  # the others: closed without a word
        # A cut-off connection's handler frees its slot just after the peer sees the close
        # (under load, a while after): wait for every slot, then the proxy serves again.
        for _ in range(proxy.max_connections):
            assert proxy.slots.acquire(timeout=10), "a cut-off connection kept its slot"
        for _ in range(proxy.max_connections):
            proxy.slots.release()
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


def test_bodies_are_bounded_before_a_byte_of_them_is_buffered(small_proxy) -> None:
    """Attack: bodies claimed by ``Content-Length`` and never sent. One claim over the body
    bound is a 413 and the sum of claims over the buffer bound a 503, before reading any."""
    proxy = small_proxy
    port = proxy.server_address[1]
    huge = socket.create_connection(("127.0.0.1", port), timeout=5)
    huge.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 10000000000\r\n\r\n")
    assert huge.recv(4096).startswith(b"HTTP/1.1 413 ")
    huge.close()
    held = []
    for _ in range(2):  # 2 x 1 MiB claimed: the 2 MiB buffer bound is reached
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1048576\r\n\r\n{")
        held.append(s)
    deadline = time.monotonic() + 10
    while proxy.buffered_bytes < 2 << 20:  # both claims are in
        assert time.monotonic() < deadline, proxy.buffered_bytes
        time.sleep(0.01)
    assert proxy.buffered_bytes == 2 << 20
    third = socket.create_connection(("127.0.0.1", port), timeout=5)
    third.sendall(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 1048576\r\n\r\n")
    answer = _whole_response(third)  # headers and body may come in separate segments
    assert answer.startswith(b"HTTP/1.1 503 ") and b"too many bodies" in answer
    third.close()
    deadline = time.monotonic() + 4 * pd_proxy.BODY_DEADLINE_S
    while proxy.buffered_bytes:  # the unsent bodies are cut off at their deadline
        assert time.monotonic() < deadline, "the claimed bodies were never released"
        time.sleep(0.1)
    for s in held:
        s.close()
    assert _completion(proxy) == 200
