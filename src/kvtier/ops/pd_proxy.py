"""``kvtier pd-proxy``: prefill/decode disaggregation through kvtier's store, as one endpoint.

Each OpenAI completion (or chat completion) goes first to a **producer** — a vLLM server with
``kv_role: kv_producer``, which computes the prompt, stores every full block through kvtier and
answers only once they are stored — with ``max_tokens: 1``; then, unchanged, to a **consumer**
(``kv_role: kv_consumer``), which loads those blocks instead of computing them and generates
the answer, streamed back as the consumer sends it. A producer that fails or times out costs
the consumer a recompute, never the request: the consumer's answer is always what is returned.

The proxy listens only where it is told (default 127.0.0.1) and bounds what clients can hold
(``kvtier.common.http_bounds``): at most ``--max-connections`` at once (one more is answered 503), a
request's headers within ``REQUEST_DEADLINE_S`` (also the idle wait of a kept-alive
connection), its body within ``BODY_DEADLINE_S``, each body at most ``MAX_BODY_BYTES`` and all
bodies held at once at most ``MAX_BUFFERED_BYTES`` (checked on ``Content-Length``, before any
byte is buffered), every read or write ``IO_TIMEOUT_S``, and every upstream wait
``--timeout-s``.
"""

from __future__ import annotations

import http.client
import json
import logging
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from kvtier.common.http_bounds import BoundedHandler, BoundedHTTPServer
from kvtier.errors import ConfigError
from kvtier.ops.cli_args import integer, positive_number

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # a 1M-token prompt as JSON token ids is about 8 MiB
MAX_BUFFERED_BYTES = 512 << 20  # bodies held at once, all connections together
MAX_CONNECTIONS = 256  # a benchmark client's concurrency fits; threads stay bounded
# Longer than the keep-alive of common clients (aiohttp 15 s, httpx 5 s), so that a client
# never reuses a connection the proxy is closing; short enough that idle peers free their slots.
REQUEST_DEADLINE_S = 30.0
BODY_DEADLINE_S = 60.0  # 64 MiB at about 1 MiB/s
IO_TIMEOUT_S = 30.0  # one read from or write to a client (a stalled reader of a stream)
ROUTES = ("/v1/completions", "/v1/chat/completions")
CHUNK_BYTES = 64 << 10


@dataclass(frozen=True)
class Upstream:
    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Upstream:
        parsed = urllib.parse.urlsplit(url if "//" in url else f"http://{url}")
        if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
            raise ValueError(f"expected http://HOST:PORT, got {url!r}")
        return cls(parsed.hostname, parsed.port)

    def connect(self, timeout_s: float) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)


class Proxy(BoundedHTTPServer):
    def __init__(
        self,
        address: tuple[str, int],
        producer: Upstream,
        consumer: Upstream,
        timeout_s: float,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        super().__init__(
            address,
            _Handler,
            max_connections=max_connections,
            io_timeout_s=IO_TIMEOUT_S,
            request_deadline_s=REQUEST_DEADLINE_S,
        )
        self.producer, self.consumer, self.timeout_s = producer, consumer, timeout_s
        self.counts = {"requests": 0, "prefill_failures": 0, "refused": 0}
        self.lock = threading.Lock()
        self.buffered_bytes = 0

    def refuse_connection(self, request: Any) -> None:
        """One connection too many: told so (503) and closed, never queued."""
        self.count("refused")
        body = b'{"error": "too many connections to kvtier pd-proxy: retry later"}'
        head = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        head += b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
        try:
            request.settimeout(1.0)  # a new connection's send buffer is empty: never waits
            request.sendall(head + body)
        except OSError:
            pass
        self.shutdown_request(request)

    def reserve(self, nbytes: int) -> bool:
        """Room for a body of ``nbytes`` within ``MAX_BUFFERED_BYTES``; ``release`` it after."""
        with self.lock:
            if self.buffered_bytes + nbytes > MAX_BUFFERED_BYTES:
                return False
            self.buffered_bytes += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self.lock:
            self.buffered_bytes -= nbytes

    def count(self, name: str) -> None:
        with self.lock:
            self.counts[name] += 1

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hangs up (after its answer, or mid-stream) is normal: one debug line,
        not socketserver's traceback on stderr."""
        error = sys.exc_info()[1]
        if isinstance(error, (ConnectionError, TimeoutError)):
            log.debug("pd-proxy: %s hung up (%s)", client_address, error)
        else:
            log.error("pd-proxy: request from %s failed", client_address, exc_info=True)


class _Handler(BoundedHandler):
    server: Proxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the base's name)
        log.debug("pd-proxy: " + format, *args)

    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
        self.server.unwatch(self.connection)  # the request is in
        if self.path == "/health":
            ok = all(_healthy(u, self.server.timeout_s) for u in self._upstreams())
            self._reply(200 if ok else 503, {"producer_and_consumer": ok})
        elif self.path == "/stats":
            self._reply(200, dict(self.server.counts))
        else:
            self._relay(self.server.consumer, "GET", None)

    def do_POST(self) -> None:  # noqa: N802
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length <= 0 or length > MAX_BODY_BYTES:
            self.server.unwatch(self.connection)
            status = 413 if length > 0 else 411 if length == 0 else 400
            self.close_connection = True  # the body, if any, is never read
            self._reply(status, {"error": f"a body of 1..{MAX_BODY_BYTES} bytes"})
            return
        if not self.server.reserve(length):
            self.server.unwatch(self.connection)
            self.close_connection = True
            self._reply(503, {"error": "kvtier pd-proxy holds too many bodies: retry later"})
            return
        try:
            self.server.watch(self.connection, BODY_DEADLINE_S)
            body = self.rfile.read(length)
            self.server.unwatch(self.connection)
            if len(body) < length:  # cut off at its deadline, or the client hung up
                self.close_connection = True
                return
            self._forward(body)
        finally:
            self.server.release(length)

    def _forward(self, body: bytes) -> None:
        if self.path in ROUTES:
            try:
                request = json.loads(body)
                if not isinstance(request, dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                self._reply(400, {"error": f"the body is not a JSON object: {e}"})
                return
            self.server.count("requests")
            self._prefill(request)
        self._relay(self.server.consumer, "POST", body)

    def _upstreams(self) -> tuple[Upstream, Upstream]:
        return self.server.producer, self.server.consumer

    def _prefill(self, request: dict[str, Any]) -> None:
        """The producer computes and stores the prompt; its one token is thrown away."""
        prefill = {**request, "max_tokens": 1, "stream": False}
        prefill.pop("stream_options", None)
        prefill.pop("max_completion_tokens", None)
        conn = self.server.producer.connect(self.server.timeout_s)
        try:
            conn.request("POST", self.path, json.dumps(prefill), _JSON)
            answer = conn.getresponse()
            answer.read()
            if answer.status != 200:
                raise OSError(f"HTTP {answer.status}")
        except (OSError, http.client.HTTPException) as e:
            self.server.count("prefill_failures")
            log.warning("pd-proxy: the producer failed (%s): the consumer computes it", e)
        finally:
            conn.close()

    def _relay(self, upstream: Upstream, method: str, body: bytes | None) -> None:
        conn = upstream.connect(self.server.timeout_s)
        try:
            conn.request(method, self.path, body, _JSON if body is not None else {})
            answer = conn.getresponse()
            self.send_response(answer.status)
            for name in ("Content-Type", "Cache-Control"):
                value = answer.getheader(name)
                if value:
                    self.send_header(name, value)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while chunk := answer.read1(CHUNK_BYTES):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except (OSError, http.client.HTTPException) as e:
            self.close_connection = True
            try:
                self._reply(502, {"error": f"the consumer failed: {e}"})
            except OSError:
                pass
        finally:
            conn.close()

    def _reply(self, status: int, data: dict[str, Any]) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


_JSON = {"Content-Type": "application/json"}


def _healthy(upstream: Upstream, timeout_s: float) -> bool:
    conn = upstream.connect(min(timeout_s, 10.0))
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def serve(
    producer: str,
    consumer: str,
    host: str,
    port: int,
    timeout_s: float,
    max_connections: int = MAX_CONNECTIONS,
) -> Proxy:
    """A started proxy (its thread serves until ``shutdown()``)."""
    proxy = Proxy(
        (host, port), Upstream.parse(producer), Upstream.parse(consumer), timeout_s, max_connections
    )
    threading.Thread(target=proxy.serve_forever, name="pd-proxy", daemon=True).start()
    return proxy


def add_pd_proxy(sub: Any, common: Any) -> None:
    """``kvtier pd-proxy``'s options."""

    p = sub.add_parser(
        "pd-proxy",
        parents=[common],
        help="one endpoint for a prefill (kv_producer) and a decode (kv_consumer) vLLM server",
        description=__doc__,
    )
    p.add_argument("--producer", required=True, help="the prefill server: http://HOST:PORT")
    p.add_argument("--consumer", required=True, help="the decode server: http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1", help="listen here only")
    p.add_argument("--port", type=integer(0, 65535), default=8000, help="0: a free port")
    p.add_argument(
        "--timeout-s",
        type=positive_number,
        default=600.0,
        help="bound on each upstream wait (a long prompt's prefill on a busy CPU takes minutes)",
    )
    p.add_argument(
        "--max-connections",
        type=integer(1, 65536),
        default=MAX_CONNECTIONS,
        help="client connections served at once; one more is answered 503",
    )
    p.set_defaults(func=_run_proxy)


def _run_proxy(args: Any) -> int:

    try:
        proxy = serve(
            args.producer,
            args.consumer,
            args.host,
            args.port,
            args.timeout_s,
            args.max_connections,
        )
    except ValueError as e:
        raise ConfigError("producer/consumer", str(e)) from None
    host, port = str(proxy.server_address[0]), proxy.server_address[1]
    print(
        f"kvtier pd-proxy on http://{host}:{port}: prefill {args.producer}, decode {args.consumer}",
        flush=True,
    )
    try:
        while True:
            time.sleep(3600)
    finally:
        proxy.shutdown()
        proxy.server_close()
