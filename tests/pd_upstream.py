"""Stand-ins for the two vLLM servers behind ``kvtier pd-proxy``, and a client's POST: shared by
``tests/process/test_pd_proxy.py`` and the attacks in ``tests/security``."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


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


def post(proxy, path: str, body: bytes, timeout_s: float = 10.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.server_address[1], timeout=timeout_s)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


@contextmanager
def proxy_between_upstreams(max_connections: int = 256) -> Iterator[tuple]:
    """(proxy, producer, consumer): a ``kvtier pd-proxy`` in this process before two stand-ins,
    all three shut down after."""
    from kvtier.ops import pd_proxy

    producer, consumer = Upstream("producer"), Upstream("consumer")
    proxy = pd_proxy.serve(producer.url, consumer.url, "127.0.0.1", 0, 10.0, max_connections)
    try:
        yield proxy, producer, consumer
    finally:
        for server in (proxy, producer, consumer):
            server.shutdown()
            server.server_close()
