"""BoundedHTTPServer: a threading HTTP server that idle, slow or many peers cannot exhaust.

The standard library's ``ThreadingHTTPServer`` starts one thread per connection, unbounded and
without a timeout: any local user can pile up threads with idle connections, or hold every
handler by trickling a byte every few seconds (each byte restarts a read timeout). Here:

- every read or write on a connection is bounded by ``io_timeout_s``;
- each request (the wait for it on a kept-alive connection, its request line and headers) must
  be in whole within ``request_deadline_s`` however the peer paces its bytes; a handler may give
  itself a new deadline (``watch``) to read a body, and calls ``unwatch`` once the request is
  in: the answer is then its own to send;
- at most ``max_connections`` are served at once, and no peer can hold them: when all are taken,
  a new connection takes the place of one still *waiting for its request*, chosen from the peer
  that holds the most (the oldest that sent nothing yet first). A peer that opens connections
  and sends nothing — reconnecting as fast as it is cut — only ever displaces its own, and a
  client whose request arrives is never displaced. Only when every connection is busy with a
  request is a new one answered by ``refuse_connection`` (closed, by default).

A peer is a user, not an address: every local account connects from 127.0.0.1, so a loopback
peer is told apart by the uid that owns its socket (``/proc/net/tcp``, as identd does); a remote
peer by its address.

Handlers derive from ``BoundedHandler``. Used by the Prometheus exporter and ``kvtier
pd-proxy``.
"""

from __future__ import annotations

import ipaddress
import select
import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class _Connection:
    peer: str
    deadline: float | None  # while it waits for a request; None while one is answered
    since: float  # when it began to wait
    displaced: bool = False


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
        self._connections: dict[socket.socket, _Connection] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._watchdog = threading.Thread(
            target=self._expire, name="kvtier-http-deadlines", daemon=True
        )
        super().__init__(address, handler)  # a failed bind calls server_close
        self._watchdog.start()

    @property
    def connections(self) -> int:
        """Connections with a handler now (displaced ones included until their handler ends)."""
        with self._lock:
            return len(self._connections)

    def peer(self, conn: socket.socket) -> str:
        with self._lock:
            known = self._connections.get(conn)
        return known.peer if known is not None else "unknown"

    def watch(self, conn: socket.socket, deadline_s: float | None = None) -> None:
        """Cut ``conn`` off unless ``unwatch``ed within ``deadline_s`` (default: the request
        deadline). A watched connection waits for its request: another may displace it."""
        seconds = self.request_deadline_s if deadline_s is None else deadline_s
        now = time.monotonic()
        with self._lock:
            if (known := self._connections.get(conn)) is not None:
                known.deadline, known.since = now + seconds, now

    def unwatch(self, conn: socket.socket) -> None:
        with self._lock:
            if (known := self._connections.get(conn)) is not None:
                known.deadline = None

    def _expire(self) -> None:
        """One thread for every connection: a request not in by its deadline is cut off (its
        handler's blocked read returns, the slot is freed)."""
        tick_s = min(self.request_deadline_s / 8, 0.5)
        while not self._stopped.wait(tick_s):
            now = time.monotonic()
            with self._lock:
                late = [c for c, k in self._connections.items() if k.deadline and k.deadline < now]
                for conn in late:
                    self._connections[conn].deadline = None
            for conn in late:
                _cut(conn)

    def server_close(self) -> None:
        self._stopped.set()
        if self._watchdog.is_alive():
            self._watchdog.join()
        super().server_close()

    def refuse_connection(self, request: socket.socket) -> None:
        """A connection while every other is busy with a request: closed, not queued."""
        self.shutdown_request(request)

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = peer_of(request)
        with self._lock:
            admitted = self._admit(peer)
            if admitted:
                now = time.monotonic()
                deadline = now + self.request_deadline_s
                self._connections[request] = _Connection(peer, deadline, now)
        if not admitted:
            self.refuse_connection(request)
            return
        request.settimeout(self.io_timeout_s)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: socket.socket) -> None:
        with self._lock:
            self._connections.pop(request, None)

    def _admit(self, peer: str) -> bool:
        """Room for one more connection of ``peer``, displacing a waiting one if need be.
        Handlers of displaced connections end within a read; until then they count, and at
        twice ``max_connections`` nothing more is admitted (threads stay bounded)."""
        live = [(c, k) for c, k in self._connections.items() if not k.displaced]
        if len(live) < self.max_connections:
            return True
        if len(self._connections) >= 2 * self.max_connections:
            return False
        waiting = [(c, k) for c, k in live if k.deadline is not None]
        if not waiting:
            return False
        held = Counter(k.peer for _, k in live)
        held[peer] += 1  # the newcomer counts: a peer at the top displaces its own
        top = max(held[k.peer] for _, k in waiting)
        choices = [(c, k) for c, k in waiting if held[k.peer] == top]
        conn, known = min(choices, key=lambda ck: (_has_sent(ck[0]), ck[1].since))
        known.displaced, known.deadline = True, None
        _cut(conn)
        return True


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


def _cut(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _has_sent(conn: socket.socket) -> bool:
    """Whether the peer has sent bytes not read yet (a request on its way), without waiting
    (a ``recv`` on a socket with a timeout would first wait for one)."""
    poller = select.poll()
    poller.register(conn, select.POLLIN)
    try:
        return bool(poller.poll(0))
    except OSError:
        return False


def peer_of(conn: socket.socket) -> str:
    """Who is on the other end: ``uid N`` for a loopback peer whose socket this host's
    ``/proc/net/tcp`` lists, else its address."""
    try:
        local, remote = conn.getsockname(), conn.getpeername()
    except OSError:
        return "unknown"
    if not isinstance(remote, tuple):
        return str(remote)
    host = remote[0]
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host
    if loopback:
        uid = _loopback_owner(conn.family, local, remote)
        if uid is not None:
            return f"uid {uid}"
    return host


def _loopback_owner(family: int, local: tuple, remote: tuple) -> int | None:
    """The uid owning the other end of a loopback connection: the socket whose local address
    is our remote one and whose remote address is our local one."""
    table = "/proc/net/tcp" if family == socket.AF_INET else "/proc/net/tcp6"
    theirs, ours = _kernel_address(family, remote), _kernel_address(family, local)
    try:
        with open(table) as f:
            next(f, None)
            for line in f:
                fields = line.split()
                if len(fields) > 7 and fields[1] == theirs and fields[2] == ours:
                    return int(fields[7])
    except (OSError, ValueError):
        return None
    return None


def _kernel_address(family: int, address: tuple) -> str:
    """``ADDRESS:PORT`` as ``/proc/net/tcp`` prints it: the address's 32-bit words in host
    order, in hex."""
    packed = socket.inet_pton(family, address[0])
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{w:08X}" for w in words) + f":{address[1]:04X}"
