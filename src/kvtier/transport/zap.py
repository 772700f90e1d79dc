"""ZeroMQ authentication helpers: the worker's ZAP handler and the client's handshake watch.

The worker's ROUTER is a CURVE server; ZeroMQ asks a ZAP handler (RFC 27) whether each client
key may connect, and ``ZapHandler`` admits exactly one: the instance's client key. The client
learns from its socket's monitor whether handshakes with the worker fail (``HandshakeWatch``):
a peer that answers on the port but cannot prove it holds the secret.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)


class ZapHandler:
    """Admits exactly one CURVE client key: ZeroMQ's authentication protocol (RFC 27) served on
    the socket owner's thread (``handle`` when the socket is readable). Owns its REP socket."""

    def __init__(
        self,
        context: zmq.Context,
        client_public: bytes,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.socket = context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)
        self._allowed = z85.decode(client_public)
        self._on_refused = on_refused

    def handle(self) -> None:
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            request_id = frames[1] if len(frames) > 1 else b""
            ok = (
                len(frames) >= 7
                and frames[5] == b"CURVE"
                and hmac.compare_digest(frames[6], self._allowed)
            )
            status, text = (b"200", b"OK") if ok else (b"400", b"unknown client key")
            self.socket.send_multipart([b"1.0", request_id, status, text, b"", b""])
            if not ok and self._on_refused is not None:
                address = frames[3] if len(frames) > 3 else b"?"
                self._on_refused(address.decode("ascii", errors="replace"))

    def close(self) -> None:
        self.socket.close(linger=0)


_HANDSHAKE_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


# A peer that does not speak CURVE, cannot open our HELLO (it lacks the worker's secret key) or
# refuses our client key fails with one of these: never the worker of this secret. ZeroMQ does
# not retry after them, so one is enough to tell.
_DEFINITE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
DEFINITE = 1 << 20  # failures counted for one definite failure: above any threshold


class HandshakeWatch:
    """Counts one connection's failed handshakes from its monitor socket: a handshake-failed
    event, or a disconnect before the handshake succeeded (a peer that closes on us). A
    definite failure (protocol or authentication) counts as ``DEFINITE``."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.monitor = sock.get_monitor_socket(_HANDSHAKE_EVENTS)
        self.failures = 0
        self._connecting = False

    def read(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_CONNECTED:
                self._connecting = True
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connecting, self.failures = False, 0
            elif event & _DEFINITE_FAILURES:
                self._connecting = False
                self.failures += DEFINITE
            elif event & _HANDSHAKE_FAILED or (
                event == zmq.EVENT_DISCONNECTED and self._connecting
            ):
                self._connecting = False
                self.failures += 1
