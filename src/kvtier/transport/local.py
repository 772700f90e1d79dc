"""The in-process transport (``local://NAME``): a worker and a client in one process, for tests
and single-process engines, with the same message flow and none of the sockets."""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

from kvtier.errors import WorkerError
from kvtier.transport.base import ClientTransport, Peer, ServerTransport
from kvtier.transport.tasks import MAX_MESSAGE_BYTES

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
