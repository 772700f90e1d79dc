"""The ZeroMQ transports: a worker's ROUTER, an engine's DEALER per rank (``ipc://``, ``tcp://``).

See ``kvtier.transport.base`` for the contract, the bounds and the authentication.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import zmq

from kvtier.errors import WorkerError
from kvtier.transport.auth import CurveKeys
from kvtier.transport.base import Channel, ClientTransport, Peer, ServerTransport
from kvtier.transport.tasks import MAX_MESSAGE_BYTES
from kvtier.transport.zap import HandshakeWatch, ZapHandler

HWM_MESSAGES = 100_000
LINGER_MS = 1000
# At close, answers already handed to ZeroMQ get this long to reach a peer that still listens;
# a peer that is gone must not hold a stopping worker (Ctrl-C ends things in about a second).
CLOSE_LINGER_MS = 200
# A connection must finish its handshake within this (ZeroMQ's default is 30 s): a stranger
# that stalls mid-handshake holds a connection and its buffer no longer than this. Generous
# for a busy machine, where the worker's loop thread answers the ZAP request.
HANDSHAKE_IVL_MS = 5000
# pyzmq's flags are enum members, and an operation on one (``flags | SNDMORE``, ``events &
# POLLIN``) builds a new member: microseconds per message, measured as a quarter of the client's
# own time under windowed lookups. Plain ints on the per-message path.
NOBLOCK = int(zmq.NOBLOCK)
SNDMORE = int(zmq.SNDMORE)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_RCVTIMEO = int(zmq.RCVTIMEO)


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
        for frame in frames[:-1]:
            sock.send(frame, SNDMORE)
        sock.send(frames[-1])

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
        out: list[tuple[Peer, bytes]] = []
        if self.router in events:  # poll saw a message: read it before asking for more
            while True:
                try:
                    frames = _recv_frames(self.router)
                except zmq.Again:  # gone since the poll (a peer's pipe ended): nothing to read
                    return out
                if len(frames) >= 2:
                    out.append((frames[0], frames[-1]))
                if not _readable(self.router):
                    return out
        return out

    def _forward_answers(self) -> None:
        while True:
            if not _readable(self.answers):
                return
            peer, payload = _recv_frames(self.answers)  # a pair: written by ``send`` below
            _send_pair(self.router, peer, payload)

    def send(self, peer: Peer, payload: bytes) -> None:
        if threading.get_ident() == self._loop_ident:
            _send_pair(self.router, peer, payload)
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
            sock = dealer(self.context, endpoint, self.curve, connect=False)
            if self.curve is not None and endpoint.startswith("tcp://"):
                watch = self._watches[rank] = HandshakeWatch(sock)
                self.poller.register(watch.monitor, zmq.POLLIN)
            sock.connect(endpoint)
            self.poller.register(sock, zmq.POLLIN)
            self.sockets.append(sock)
        self._rank_of = {sock: rank for rank, sock in enumerate(self.sockets)}
        self._watch_of = {w.monitor: w for w in self._watches.values()}

    def channel(self) -> ZmqChannel:
        return ZmqChannel(self.context, self.endpoints, self.curve)

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
            while _readable(sock):
                out.append((rank, sock.recv(NOBLOCK)))
        return out

    def send(self, rank: int, payload: bytes) -> None:
        try:  # never block the I/O thread: a DEALER with no live connection would
            self.sockets[rank].send(payload, NOBLOCK)
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


class ZmqChannel(Channel):
    """A DEALER per rank, for one calling thread (``kvtier.engine.direct``).

    A receive is one blocking ``recv`` with the socket's receive timeout (set again only when
    the wait asked for changes): no poller and no readiness query, each of which costs a
    libzmq call (asking a socket for its events processes its command queue) on every answer.
    """

    def __init__(
        self, context: zmq.Context, endpoints: Sequence[str], curve: CurveKeys | None
    ) -> None:
        self.sockets = [dealer(context, endpoint, curve) for endpoint in endpoints]
        self._timeouts_ms = [-1] * len(self.sockets)  # each socket's RCVTIMEO now (-1: none)

    def send(self, rank: int, payload: bytes) -> None:
        try:  # a rank with no live connection: its answer never comes; the call times out
            self.sockets[rank].send(payload, NOBLOCK)
        except zmq.Again:
            pass

    def receive(self, rank: int, timeout_s: float) -> bytes | None:
        sock = self.sockets[rank]
        timeout_ms = max(0, int(timeout_s * 1000))
        if timeout_ms != self._timeouts_ms[rank]:
            sock.setsockopt(_RCVTIMEO, timeout_ms)
            self._timeouts_ms[rank] = timeout_ms
        try:
            return sock.recv()
        except zmq.Again:
            return None

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)


def dealer(
    context: zmq.Context, endpoint: str, curve: CurveKeys | None, connect: bool = True
) -> zmq.Socket:
    """A client DEALER for ``endpoint``; on ``tcp://`` with ``curve`` it pins the worker's key."""
    sock = configure(context.socket(zmq.DEALER))
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
    if curve is not None and endpoint.startswith("tcp://"):
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.client_public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, curve.client_secret)
    if connect:
        sock.connect(endpoint)
    return sock


def _readable(sock: zmq.Socket) -> bool:
    """A whole message waits (no exception raised and caught per empty read)."""
    return bool(int(sock.get(_EVENTS)) & _POLLIN)


def _recv_frames(sock: zmq.Socket) -> list[bytes]:
    """A whole message that waits, frame by frame (each frame says whether more follow: no
    socket option read per frame, which costs pyzmq an enum lookup)."""
    frame = sock.recv(NOBLOCK, copy=False)
    frames = [frame.bytes]
    while frame.more:
        frame = sock.recv(NOBLOCK, copy=False)
        frames.append(frame.bytes)
    return frames


def _send_pair(router: zmq.Socket, peer: bytes, payload: bytes) -> None:
    """``payload`` to ``peer`` (a ROUTER drops what it cannot route or queue: never blocks)."""
    router.send(peer, SNDMORE)
    router.send(payload)


def _drain(sock: zmq.Socket) -> None:
    while True:
        try:
            sock.recv(NOBLOCK)
        except zmq.Again:
            return
