"""``kvtier pd-proxy`` between two real HTTP servers standing in for vLLM's (the real-engine
case is ``tests/engine/test_vllm_serve.py``): what each side receives, streaming passed through,
bad input answered, a failed side handled."""

from __future__ import annotations

import http.client
import json
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtier import pd_proxy


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


def post(proxy, path: str, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1], timeout=10)
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
    assert proxy.counts == {"requests": 1, "prefill_failures": 1}


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
