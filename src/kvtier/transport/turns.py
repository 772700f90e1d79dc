"""TurnSender: what a loop thread sends during one turn, sent at the turn's end in bundles.

A worker's loop receives what queued up while it was busy (a window of lookups from one
engine: tens of messages) and answers each. Sent one by one, every answer costs a send, a wake
of ZeroMQ's I/O thread and, at the engine, a receive: tens of microseconds each, more than the
lookup itself. Held until the turn ends, the answers to one peer leave as one frame
(``kvtier.transport.tasks.bundle``). Messages sent by other threads (the executors' answers)
go out at once, as before; so does everything once ``stop`` is called.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvtier.transport.base import Peer
from kvtier.transport.tasks import bundle


class TurnSender:
    def __init__(self, send: Callable[[Peer, bytes], None]) -> None:
        self._send = send
        self._owner: int | None = None
        self._held: dict[Peer, list[bytes]] = {}

    def start(self) -> None:
        """The calling thread's sends are held from now on, until ``flush``."""
        self._owner = threading.get_ident()

    def send(self, peer: Peer, payload: bytes) -> None:
        if threading.get_ident() == self._owner:
            self._held.setdefault(peer, []).append(payload)
        else:
            self._send(peer, payload)

    def flush(self) -> None:
        """The end of a turn: what was held leaves, in order, one frame per peer at most (more
        only past a bundle's bounds)."""
        if not self._held:
            return
        held, self._held = self._held, {}
        for peer, payloads in held.items():
            for frame in bundle(payloads):
                self._send(peer, frame)

    def stop(self) -> None:
        """Flush, and send everything at once from now on (a loop that ended)."""
        self.flush()
        self._owner = None
