"""Transports: how encoded messages travel between a Client and its workers — the seam.

Two interfaces, each with two implementations chosen by the endpoint's scheme
(``kvtier.transport.connect``): ZeroMQ (``kvtier.transport.zeromq``) and in-process
(``kvtier.transport.local``):

- ``ServerTransport`` (the worker's end): ``receive`` waits for messages from any peer (loop
  thread only); ``send`` answers a peer from any thread.
- ``ClientTransport`` (the engine's end): one connection per rank; ``receive`` and ``send`` from
  the client's I/O thread only; ``wake`` (any thread) makes a pending ``receive`` return.
  ``channel`` opens a ``Channel``: a calling thread's own connection to every rank, so a
  synchronous call needs no hand-off to the I/O thread and back (``kvtier.engine.direct``).

``ipc://`` and ``tcp://`` endpoints use ZeroMQ (ROUTER / DEALER). ``local://NAME`` is an
in-process pair of queues: a worker and a client in one process, for tests and single-process
engines, with the same message flow and none of the sockets.

Bounds: a ZeroMQ socket drops any message larger than ``MAX_MESSAGE_BYTES`` before it is read;
high-water marks are raised deliberately (pipelining past the default 1000 made ROUTER drop
replies silently in the design we replace) and both sides bound their windows far below them.

Authentication (``tcp://``, see ``kvtier.transport.auth``): given ``CurveKeys``, the worker's
ROUTER is a CURVE server whose ZAP handler (served on the worker's loop thread) admits only the
instance's client key, and each client DEALER pins the worker's server key. A peer that cannot
complete the handshake exchanges no application frame with us; before it fails, it can make
libzmq buffer at most one message of ``MAX_MESSAGE_BYTES``, for at most ``HANDSHAKE_IVL_MS``.
The client counts failed handshakes per rank (``failed_handshakes``): a peer that answers on the
port but cannot prove it holds the secret is a worker with another secret or an impostor.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

Peer = bytes
LOCAL_SCHEME = "local://"  # in-process transport (tests, single-process engines)


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

    def channel(self) -> Channel | None:
        """A new connection to every rank for one calling thread, or None where the transport
        has none (in-process: calls go through the I/O thread)."""
        return None

    def failed_handshakes(self, rank: int) -> int:
        """I/O thread only: handshakes with ``rank``'s endpoint that failed since the last one
        that succeeded (a peer that cannot prove it is the worker). 0 without authentication."""
        return 0

    @abstractmethod
    def close(self) -> None: ...


class Channel(ABC):
    """One thread's own connection to every rank (``ClientTransport.channel``): that thread
    alone sends and receives on it; ``close`` may come from another thread once it is idle."""

    @abstractmethod
    def send(self, rank: int, payload: bytes) -> None: ...

    @abstractmethod
    def receive(self, rank: int, timeout_s: float) -> bytes | None:
        """The next message from ``rank``, waiting up to ``timeout_s``; None if none came. A
        caller that needs every rank's answer waits on each rank in turn: what another rank
        sends meanwhile waits in that rank's connection."""

    @abstractmethod
    def close(self) -> None: ...
