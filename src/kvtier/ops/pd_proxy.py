"""``kvtier pd-proxy``: prefill/decode disaggregation through kvtier's store, as one endpoint.

Each OpenAI completion (or chat completion) goes first to a **producer** — a vLLM server with
``kv_role: kv_producer``, which computes the prompt, stores every full block through kvtier and
answers only once they are stored — with ``max_tokens: 1``; then, unchanged, to a **consumer**
(``kv_role: kv_consumer``), which loads those blocks instead of computing them and generates
the answer, streamed back as the consumer sends it. A producer that fails or times out costs
the consumer a recompute, never the request: the consumer's answer is always what is returned.

The proxy listens only where it is told (default 127.0.0.1; another address gets a warning:
it has no authentication) and relays only the OpenAI completion routes, ``/v1/models`` and
``/health`` — never vLLM's admin routes (``/sleep``, ``/reset_prefix_cache``, LoRA loading). It
bounds what clients can hold (``kvtier.common.http_bounds``): at most ``--max-connections``
served at once, and a peer (a local user, or a remote address) that fills them with idle
connections only displaces its own; a request's headers within ``REQUEST_DEADLINE_S`` (also the
idle wait of a kept-alive connection); a body at most ``MAX_BODY_BYTES``, arriving at
``BODY_MIN_RATE`` or better; bodies and their parsed forms held at once at most
``MAX_BUFFERED_BYTES``, reserved as their bytes arrive (a claimed ``Content-Length`` reserves
nothing), a peer at most half of it; every read or write ``IO_TIMEOUT_S``, and every upstream
wait ``--timeout-s``.
"""

from __future__ import annotations

import http.client
import json
import logging
import sys
import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any

from kvtier.common.http_bounds import BoundedHandler, BoundedHTTPServer

log = logging.getLogger(__name__)

# A 1M-token prompt as JSON token ids is about 8 MiB; as text, about 4 MiB.
MAX_BODY_BYTES = 16 << 20
MAX_BUFFERED_BYTES = 512 << 20  # bodies and their parsed forms, all connections together
PEER_SHARE = 2  # a peer may hold 1/PEER_SHARE of MAX_BUFFERED_BYTES
# A parsed JSON body's Python objects per byte of its JSON (measured: a 64 MiB body of token ids
# took the proxy from 27 to 605 MiB).
PARSE_FACTOR = 9
MAX_CONNECTIONS = 256  # a benchmark client's concurrency fits; threads stay bounded
# Longer than the keep-alive of common clients (aiohttp 15 s, httpx 5 s), so that a client
# never reuses a connection the proxy is closing; short enough that idle peers free their slots.
REQUEST_DEADLINE_S = 30.0
BODY_GRACE_S = 5.0  # a body's deadline: this, plus its length at BODY_MIN_RATE
BODY_MIN_RATE = 1 << 20  # bytes a second: a loopback client sends a prompt at GB/s
IO_TIMEOUT_S = 30.0  # one read from or write to a client (a stalled reader of a stream)
ROUTES = ("/v1/completions", "/v1/chat/completions")
GET_ROUTES = ("/v1/models", "/health")
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
        self.held: dict[str, int] = {}  # bytes reserved, by peer

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

    def reserve(self, peer: str, nbytes: int) -> bool:
        """Room for ``nbytes`` more of ``peer``'s within ``MAX_BUFFERED_BYTES`` and its share
        of it; ``release`` them after."""
        with self.lock:
            held = self.held.get(peer, 0)
            if (
                self.buffered_bytes + nbytes > MAX_BUFFERED_BYTES
                or held + nbytes > MAX_BUFFERED_BYTES // PEER_SHARE
            ):
                return False
            self.buffered_bytes += nbytes
            self.held[peer] = held + nbytes
            return True

    def release(self, peer: str, nbytes: int) -> None:
        with self.lock:
            self.buffered_bytes -= nbytes
            left = self.held.pop(peer, 0) - nbytes
            if left:
                self.held[peer] = left

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
        elif self.path in GET_ROUTES:
            self._relay(self.server.consumer, "GET", None)
        else:
            self._not_relayed()

    def do_POST(self) -> None:  # noqa: N802
        if self.path not in ROUTES:
            self.server.unwatch(self.connection)
            self.close_connection = True  # the body, if any, is never read
            self._not_relayed()
            return
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
        peer = self.server.peer(self.connection)
        body = self._read_body(peer, length)
        if body is None:
            return
        try:
            self._forward(peer, body)
        finally:
            self.server.release(peer, len(body))

    def _read_body(self, peer: str, length: int) -> bytearray | None:
        """The body, its bytes reserved as they arrive; None (answered or cut off) when it does
        not arrive by ``BODY_GRACE_S`` + its length at ``BODY_MIN_RATE``, or the bytes held are
        at their bound."""
        self.server.watch(self.connection, BODY_GRACE_S + length / BODY_MIN_RATE)
        body = bytearray()
        try:
            while len(body) < length:
                chunk = self.rfile.read1(min(CHUNK_BYTES, length - len(body)))
                if not chunk:  # cut off at its deadline, or the client hung up
                    break
                if not self.server.reserve(peer, len(chunk)):
                    self.server.unwatch(self.connection)
                    self.close_connection = True
                    self._reply(
                        503, {"error": "kvtier pd-proxy holds too many bodies: retry later"}
                    )
                    break
                body += chunk
        except OSError:
            pass
        if len(body) == length:
            self.server.unwatch(self.connection)
            return body
        self.close_connection = True
        self.server.release(peer, len(body))
        return None

    def _too_many_bodies(self) -> None:
        self.close_connection = True
        self._reply(503, {"error": "kvtier pd-proxy holds too many bodies: retry later"})

    def _not_relayed(self) -> None:
        routes = ", ".join((*ROUTES, *GET_ROUTES, "/stats"))
        self._reply(404, {"error": f"kvtier pd-proxy serves only {routes}"})

    def _forward(self, peer: str, body: bytearray) -> None:
        """The producer's prefill (from the parsed body, its memory reserved while it lives),
        then the consumer's answer."""
        if not self.server.reserve(peer, PARSE_FACTOR * len(body)):
            self._too_many_bodies()
            return
        try:
            try:
                request = json.loads(body)
                if not isinstance(request, dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:
                self._reply(400, {"error": f"the body is not a JSON object: {e}"})
                return
            self.server.count("requests")
            self._prefill(request)
            del request
        finally:
            self.server.release(peer, PARSE_FACTOR * len(body))
        self._relay(self.server.consumer, "POST", body)  # bytes-like: sent as it is, not copied

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

    def _relay(self, upstream: Upstream, method: str, body: bytes | bytearray | None) -> None:
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
