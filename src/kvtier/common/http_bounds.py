"""BoundedHTTPServer: a threading HTTP server that idle, slow or many peers cannot exhaust.

The standard library's ``ThreadingHTTPServer`` starts one thread per connection, unbounded and
without a timeout: any local user can pile up threads with idle connections, or hold every
handler by trickling a byte every few seconds (each byte restarts a read timeout). Here:

- at most ``max_connections`` handlers at once; one more connection is answered by
  ``refuse_connection`` (closed, by default) and never queued;
- every read or write on a connection is bounded by ``io_timeout_s``;
- each request (the wait for it on a kept-alive connection, its request line and headers) must
  be in whole within ``request_deadline_s`` however the peer paces its bytes; a handler may give
  itself a new deadline (``watch``) to read a body, and calls ``unwatch`` once the request is
  in: the answer is then its own to send.

Handlers derive from ``BoundedHandler``. Used by the Prometheus exporter and ``kvtier
pd-proxy``.
"""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class BoundedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BoundedHandler],
        *,
        max_connections: int,
        io_timeout_s: float,
        request_deadline_s: float,
    ) -> None:
        self.max_connections = max_connections
        self.io_timeout_s = io_timeout_s
        self.request_deadline_s = request_deadline_s
        self.slots = threading.BoundedSemaphore(max_connections)
        self._deadlines: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._watchdog = threading.Thread(
            target=self._expire, name="kvtier-http-deadlines", daemon=True
        )
        super().__init__(address, handler)  # a failed bind calls server_close
        self._watchdog.start()

    def watch(self, conn: socket.socket, deadline_s: float | None = None) -> None:
        """Cut ``conn`` off unless ``unwatch``ed within ``deadline_s`` (default: the request
        deadline)."""
        seconds = self.request_deadline_s if deadline_s is None else deadline_s
        with self._lock:
            self._deadlines[conn] = time.monotonic() + seconds

    def unwatch(self, conn: socket.socket) -> None:
        with self._lock:
            self._deadlines.pop(conn, None)

    def _expire(self) -> None:
        """One thread for every connection: a request not in by its deadline is cut off (its
        handler's blocked read returns, the slot is freed)."""
        tick_s = min(self.request_deadline_s / 8, 0.5)
        while not self._stopped.wait(tick_s):
            now = time.monotonic()
            with self._lock:
                late = [c for c, deadline in self._deadlines.items() if deadline < now]
                for conn in late:
                    del self._deadlines[conn]
            for conn in late:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def server_close(self) -> None:
        self._stopped.set()
        if self._watchdog.is_alive():
            self._watchdog.join()
        super().server_close()

    def refuse_connection(self, request: socket.socket) -> None:
        """A connection beyond ``max_connections``: closed, not queued."""
        self.shutdown_request(request)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.refuse_connection(request)
            return
        request.settimeout(self.io_timeout_s)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class BoundedHandler(BaseHTTPRequestHandler):
    """Each request is watched from the moment the handler waits for it (``handle_one_request``)
    until the handler calls ``self.server.unwatch(self.connection)``."""

    server: BoundedHTTPServer

    def handle_one_request(self) -> None:
        self.server.watch(self.connection)
        super().handle_one_request()

    def finish(self) -> None:
        self.server.unwatch(self.connection)
        super().finish()
