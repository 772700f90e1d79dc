"""Transports: how encoded messages travel between a Client and its workers.

Two seams, each with two implementations chosen by the endpoint's scheme:

- ``ServerTransport`` (the worker's end): ``receive`` waits for messages from any peer (loop
  thread only); ``send`` answers a peer from any thread.
- ``ClientTransport`` (the engine's end): one connection per rank; ``receive`` and ``send`` from
  the client's I/O thread only; ``wake`` (any thread) makes a pending ``receive`` return.

``ipc://`` and ``tcp://`` endpoints use ZeroMQ (ROUTER / DEALER). ``local://NAME`` is an
in-process pair of queues: a worker and a client in one process, for tests and single-process
engines, with the same message flow and none of the sockets.

Bounds: a ZeroMQ socket drops any message larger than ``MAX_MESSAGE_BYTES`` before it is read;
high-water marks are raised deliberately (pipelining past the default 1000 made ROUTER drop
replies silently in the design we replace) and both sides bound their windows far below them.

Authentication (``tcp://``, see ``kvtier.auth``): given ``CurveKeys``, the worker's ROUTER is a
CURVE server whose ZAP handler (served on the worker's loop thread) admits only the instance's
client key, and each client DEALER pins the worker's server key. A peer that cannot complete
the handshake exchanges no application frame with us; before it fails, it can make libzmq
buffer at most one message of ``MAX_MESSAGE_BYTES``, for at most ``HANDSHAKE_IVL_MS``. The
client counts failed handshakes per rank (``failed_handshakes``): a peer that answers on the
port but cannot prove it holds the secret is a worker with another secret or an impostor.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import zmq

from kvtier.auth import CurveKeys
from kvtier.config import LOCAL_SCHEME
from kvtier.tasks import MAX_MESSAGE_BYTES
from kvtier.zmq_auth import HandshakeWatch, ZapHandler

HWM_MESSAGES = 100_000
LINGER_MS = 1000
# At close, answers already handed to ZeroMQ get this long to reach a peer that still listens;
# a peer that is gone must not hold a stopping worker (Ctrl-C ends things in about a second).
CLOSE_LINGER_MS = 200
# A connection must finish its handshake within this (ZeroMQ's default is 30 s): a stranger
# that stalls mid-handshake holds a connection and its buffer no longer than this. Generous
# for a busy machine, where the worker's loop thread answers the ZAP request.
HANDSHAKE_IVL_MS = 5000

Peer = bytes


class ServerTransport(ABC):
    """A worker's end. Not usable before ``open`` or after ``close``."""

    @abstractmethod
    def open(self) -> None:
        """Bind; raises WorkerError when the endpoint cannot be bound."""

    @abstractmethod
    def receive(self, timeout_s: float) -> list[tuple[Peer, bytes]]:
        """Loop thread only: deliver pending answers, then wait up to ``timeout_s`` for
        messages; returns (peer, payload) pairs in arrival order (possibly none)."""

    @abstractmethod
    def send(self, peer: Peer, payload: bytes) -> None:
        """Queue ``payload`` for ``peer``; any thread. Delivered by the next ``receive``
        (immediately when called from the loop thread)."""

    @abstractmethod
    def flush(self, timeout_s: float) -> None:
        """Loop thread only: deliver queued answers, waiting up to ``timeout_s`` for more."""

    @abstractmethod
    def close(self) -> None: ...


class ClientTransport(ABC):
    """An engine's end: one connection per rank, in rank order."""

    @abstractmethod
    def open(self) -> None: ...

    @abstractmethod
    def receive(self, timeout_s: float) -> list[tuple[int, bytes]]:
        """I/O thread only: (rank, payload) pairs that arrived, waiting up to ``timeout_s``."""

    @abstractmethod
    def send(self, rank: int, payload: bytes) -> None:
        """I/O thread only."""

    @abstractmethod
    def wake(self) -> None:
        """Any thread: make a pending or the next ``receive`` return at once."""

    def failed_handshakes(self, rank: int) -> int:
        """I/O thread only: handshakes with ``rank``'s endpoint that failed since the last one
        that succeeded (a peer that cannot prove it is the worker). 0 without authentication."""
        return 0

    @abstractmethod
    def close(self) -> None: ...


def server_transport(
    endpoint: str,
    curve: CurveKeys | None = None,
    on_refused: Callable[[str], None] | None = None,
) -> ServerTransport:
    """The transport for ``endpoint``; ``curve`` authenticates peers (``tcp://``), and
    ``on_refused(address)`` hears of each peer whose handshake was refused."""
    if endpoint.startswith(LOCAL_SCHEME):
        return LocalServer(endpoint)
    return ZmqServer(endpoint, curve, on_refused)


def client_transport(endpoints: Sequence[str], curve: CurveKeys | None = None) -> ClientTransport:
    local = [e.startswith(LOCAL_SCHEME) for e in endpoints]
    if all(local):
        return LocalClient(endpoints)
    if any(local):
        raise ValueError("local:// endpoints cannot be mixed with socket endpoints")
    return ZmqClient(endpoints, curve)


# ---- ZeroMQ -----------------------------------------------------------------------------------


def configure(sock: zmq.Socket) -> zmq.Socket:
    sock.setsockopt(zmq.SNDHWM, HWM_MESSAGES)
    sock.setsockopt(zmq.RCVHWM, HWM_MESSAGES)
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    return sock


class ThreadLocalPush:
    """One PUSH socket per thread, connected to an inproc PULL owned by a loop thread.

    ZeroMQ sockets are not thread-safe; other threads hand frames to the socket-owning loop
    through these. ``close()`` closes every socket it made.
    """

    def __init__(self, context: zmq.Context, address: str) -> None:
        self._context = context
        self._address = address
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def send(self, frames: list[bytes]) -> None:
        sock = getattr(self._local, "socket", None)
        if sock is None:
            with self._lock:
                if self._closed:
                    return
                sock = self._context.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, HWM_MESSAGES)
                sock.setsockopt(zmq.LINGER, LINGER_MS)
                sock.connect(self._address)
                self._sockets.append(sock)
            self._local.socket = sock
        sock.send_multipart(frames)

    def close(self) -> None:
        """Close every socket; what they still hold is dropped (the owner flushed first)."""
        with self._lock:
            self._closed = True
            for sock in self._sockets:
                sock.close(linger=0)
            self._sockets.clear()


class ZmqServer(ServerTransport):
    def __init__(
        self,
        endpoint: str,
        curve: CurveKeys | None = None,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.curve = curve
        self._on_refused = on_refused
        self._loop_ident: int | None = None
        self.zap: ZapHandler | None = None

    def open(self) -> None:
        from kvtier.errors import WorkerError

        self.context = zmq.Context()
        self.router = configure(self.context.socket(zmq.ROUTER))
        self.router.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
        if self.curve is not None:  # the ZAP handler must exist before the first connection
            self.zap = ZapHandler(self.context, self.curve.client_public, self._on_refused)
            self.router.setsockopt(zmq.CURVE_SERVER, 1)
            self.router.setsockopt(zmq.CURVE_SECRETKEY, self.curve.server_secret)
            self.router.setsockopt(zmq.CURVE_PUBLICKEY, self.curve.server_public)
        try:
            self.router.bind(self.endpoint)
        except zmq.ZMQError as e:
            self.router.close(0)
            if self.zap is not None:
                self.zap.close()
            self.context.term()
            raise WorkerError(f"cannot bind {self.endpoint}: {e}") from None
        address = f"inproc://kvtier-answers-{id(self)}"
        self.answers = self.context.socket(zmq.PULL)
        self.answers.bind(address)
        self.push = ThreadLocalPush(self.context, address)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.poller.register(self.answers, zmq.POLLIN)
        if self.zap is not None:
            self.poller.register(self.zap.socket, zmq.POLLIN)

    def receive(self, timeout_s: float) -> list[tuple[Peer, bytes]]:
        self._loop_ident = threading.get_ident()
        events = dict(self.poller.poll(int(timeout_s * 1000)))
        if self.zap is not None and self.zap.socket in events:
            self.zap.handle()
        if self.answers in events:
            self._forward_answers()
        out = []
        if self.router in events:
            while True:
                try:
                    frames = self.router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) >= 2:
                    out.append((frames[0], frames[-1]))
        return out

    def _forward_answers(self) -> None:
        while True:
            try:
                frames = self.answers.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.router.send_multipart(frames)

    def send(self, peer: Peer, payload: bytes) -> None:
        if threading.get_ident() == self._loop_ident:
            self.router.send_multipart([peer, payload])
        else:
            self.push.send([peer, payload])

    def flush(self, timeout_s: float) -> None:
        while self.answers.poll(int(timeout_s * 1000)):
            self._forward_answers()

    def close(self) -> None:
        self.push.close()
        self.answers.close(linger=0)
        self.router.close(linger=CLOSE_LINGER_MS)
        if self.zap is not None:
            self.zap.close()
        self.context.term()


class ZmqClient(ClientTransport):
    def __init__(self, endpoints: Sequence[str], curve: CurveKeys | None = None) -> None:
        self.endpoints = list(endpoints)
        self.curve = curve
        self._watches: dict[int, HandshakeWatch] = {}

    def open(self) -> None:
        self.context = zmq.Context()
        address = f"inproc://kvtier-wake-{id(self)}"
        self._wake_pull = self.context.socket(zmq.PULL)
        self._wake_pull.bind(address)
        self._wake_push = ThreadLocalPush(self.context, address)
        self.poller = zmq.Poller()
        self.poller.register(self._wake_pull, zmq.POLLIN)
        self.sockets = []
        for rank, endpoint in enumerate(self.endpoints):
            sock = configure(self.context.socket(zmq.DEALER))
            sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
            if self.curve is not None and endpoint.startswith("tcp://"):
                sock.setsockopt(zmq.CURVE_SERVERKEY, self.curve.server_public)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, self.curve.client_public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, self.curve.client_secret)
                watch = self._watches[rank] = HandshakeWatch(sock)
                self.poller.register(watch.monitor, zmq.POLLIN)
            sock.connect(endpoint)
            self.poller.register(sock, zmq.POLLIN)
            self.sockets.append(sock)
        self._rank_of = {sock: rank for rank, sock in enumerate(self.sockets)}
        self._watch_of = {w.monitor: w for w in self._watches.values()}

    def failed_handshakes(self, rank: int) -> int:
        watch = self._watches.get(rank)
        return watch.failures if watch is not None else 0

    def receive(self, timeout_s: float) -> list[tuple[int, bytes]]:
        events = dict(self.poller.poll(int(timeout_s * 1000)))
        out = []
        for sock in events:
            if sock is self._wake_pull:
                _drain(sock)
                continue
            if sock in self._watch_of:
                self._watch_of[sock].read()
                continue
            rank = self._rank_of[sock]
            while True:
                try:
                    out.append((rank, sock.recv(zmq.NOBLOCK)))
                except zmq.Again:
                    break
        return out

    def send(self, rank: int, payload: bytes) -> None:
        try:  # never block the I/O thread: a DEALER with no live connection would
            self.sockets[rank].send(payload, zmq.NOBLOCK)
        except zmq.Again:
            pass  # like a lost datagram: a hello is resent, a task times out and is answered

    def wake(self) -> None:
        self._wake_push.send([b""])

    def close(self) -> None:
        self._wake_push.close()
        for rank, watch in self._watches.items():
            self.sockets[rank].disable_monitor()
            watch.monitor.close(linger=0)
        for sock in self.sockets:
            sock.close(linger=0)
        self._wake_pull.close(linger=0)
        self.context.term()


def _drain(sock: zmq.Socket) -> None:
    while True:
        try:
            sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return


# ---- in process -------------------------------------------------------------------------------

_local_servers: dict[str, LocalServer] = {}
_local_lock = threading.Lock()
_WAKE = object()


class LocalServer(ServerTransport):
    """A worker's end in this process: an inbox of (peer, payload) and per-peer outboxes."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.clients: dict[Peer, LocalClient] = {}

    def open(self) -> None:
        from kvtier.errors import WorkerError

        with _local_lock:
            if self.endpoint in _local_servers:
                raise WorkerError(f"cannot bind {self.endpoint}: already in use")
            _local_servers[self.endpoint] = self

    def receive(self, timeout_s: float) -> list[tuple[Peer, bytes]]:
        out: list[tuple[Peer, bytes]] = []
        try:
            item = self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            return out
        while True:
            if len(item[1]) <= MAX_MESSAGE_BYTES:
                out.append(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return out

    def send(self, peer: Peer, payload: bytes) -> None:
        client = self.clients.get(peer)
        if client is not None:
            client.deliver(self, payload)

    def flush(self, timeout_s: float) -> None:
        """Answers are delivered as they are sent: nothing is queued here."""

    def close(self) -> None:
        with _local_lock:
            if _local_servers.get(self.endpoint) is self:
                del _local_servers[self.endpoint]


class LocalClient(ClientTransport):
    def __init__(self, endpoints: Sequence[str]) -> None:
        self.endpoints = list(endpoints)
        self.identity: Peer = f"local-client-{id(self)}".encode()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._servers: list[LocalServer | None] = [None] * len(self.endpoints)

    def open(self) -> None:
        """Connect lazily: like ZeroMQ, a worker may bind after its client connects."""

    def _server(self, rank: int) -> LocalServer | None:
        server = self._servers[rank]
        if server is None:
            with _local_lock:
                server = _local_servers.get(self.endpoints[rank])
            if server is not None:
                server.clients[self.identity] = self
                self._servers[rank] = server
        return server

    def deliver(self, server: LocalServer, payload: bytes) -> None:
        self.inbox.put((self._servers.index(server), payload))

    def receive(self, timeout_s: float) -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        try:
            item = self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            return out
        while True:
            if item is not _WAKE:
                out.append(item)
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return out

    def send(self, rank: int, payload: bytes) -> None:
        server = self._server(rank)
        if server is not None:  # not bound (yet): dropped, as a lost datagram; hello is resent
            server.inbox.put((self.identity, payload))

    def wake(self) -> None:
        self.inbox.put(_WAKE)

    def close(self) -> None:
        for server in self._servers:
            if server is not None:
                server.clients.pop(self.identity, None)
