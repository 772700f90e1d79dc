"""``kvtier pd-proxy``: prefill/decode disaggregation through kvtier's store, as one endpoint.

Each OpenAI completion (or chat completion) goes first to a **producer** — a vLLM server with
``kv_role: kv_producer``, which computes the prompt, stores every full block through kvtier and
answers only once they are stored — with ``max_tokens: 1``; then, unchanged, to a **consumer**
(``kv_role: kv_consumer``), which loads those blocks instead of computing them and generates
the answer, streamed back as the consumer sends it. A producer that fails or times out costs
the consumer a recompute, never the request: the consumer's answer is always what is returned.

The proxy listens only where it is told (default 127.0.0.1), reads bodies up to
``MAX_BODY_BYTES``, and bounds every upstream wait (``--timeout-s``).
"""

from __future__ import annotations

import http.client
import json
import logging
import sys
import threading
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # a 1M-token prompt as JSON token ids is about 8 MiB
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


class Proxy(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, producer: Upstream, consumer: Upstream, timeout_s: float):
        super().__init__(address, _Handler)
        self.producer, self.consumer, self.timeout_s = producer, consumer, timeout_s
        self.counts = {"requests": 0, "prefill_failures": 0}
        self.lock = threading.Lock()

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


class _Handler(BaseHTTPRequestHandler):
    server: Proxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (the base's name)
        log.debug("pd-proxy: " + format, *args)

    def do_GET(self) -> None:  # noqa: N802  (http.server's name)
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
            status = 413 if length > 0 else 411 if length == 0 else 400
            self._reply(status, {"error": f"a body of 1..{MAX_BODY_BYTES} bytes"})
            return
        body = self.rfile.read(length)
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


def serve(producer: str, consumer: str, host: str, port: int, timeout_s: float) -> Proxy:
    """A started proxy (its thread serves until ``shutdown()``)."""
    proxy = Proxy((host, port), Upstream.parse(producer), Upstream.parse(consumer), timeout_s)
    threading.Thread(target=proxy.serve_forever, name="pd-proxy", daemon=True).start()
    return proxy


def add_pd_proxy(sub: Any, common: Any) -> None:
    """``kvtier pd-proxy``'s options."""
    from kvtier.cli_args import integer, positive_number

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
    p.set_defaults(func=_run_proxy)


def _run_proxy(args: Any) -> int:
    import time

    try:
        proxy = serve(args.producer, args.consumer, args.host, args.port, args.timeout_s)
    except ValueError as e:
        from kvtier.errors import ConfigError

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
