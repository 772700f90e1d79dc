"""PeerTable: which peers of a worker said an accepted hello, and a log that strangers cannot flood.

Who may connect at all is settled below this layer: an ``ipc://`` socket sits in a private
directory, and a ``tcp://`` worker admits only peers that complete the CURVE handshake with the
instance's client key (``kvtier.transport.base``). A hello then settles the protocol version and
the peer's role (an engine, or an observer that may only ask for stats).

Refusals are logged as one line per peer per ``REFUSAL_LOG_INTERVAL_S``, with the count of
refusals since that peer's last line: a peer that retries in a loop costs a line a minute, not
gigabytes a day.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from kvtier.transport import tasks as t

log = logging.getLogger("kvtier.worker.loop")

REFUSAL_LOG_INTERVAL_S = 60.0
# Peers remembered (accepted or refused). Past this, refused peers and observers (each
# `kvtier status` run is a new one) are forgotten first, oldest first: an engine is forgotten
# only when nothing else is left to forget (it would then have to say hello again).
MAX_PEERS = 4096


@dataclass
class _Peer:
    accepted: bool
    observer: bool = False


class PeerTable:
    """The peers of one worker, by transport identity. Loop thread only."""

    def __init__(self, rank: int, max_peers: int = MAX_PEERS) -> None:
        self.rank = rank
        self.max_peers = max_peers
        self._peers: OrderedDict[bytes, _Peer] = OrderedDict()
        self.refusals = RefusalLog(f"rank {rank}")

    def hello(self, peer: bytes, hello: t.Hello) -> tuple[bool, str]:
        """Accept or refuse ``hello``; returns (accepted, why not)."""
        if hello.protocol_version != t.PROTOCOL_VERSION:
            self._remember(peer, _Peer(accepted=False))
            why = (
                f"protocol version {hello.protocol_version} is not supported; this worker "
                f"speaks {t.PROTOCOL_VERSION}: upgrade kvtier on both sides"
            )
            self.refusals.note(f"client {hello.client_id[:40]!r}", why)
            return False, why
        self._remember(peer, _Peer(accepted=True, observer=hello.observer))
        return True, ""

    def accepted(self, peer: bytes) -> bool:
        found = self._peers.get(peer)
        return found is not None and found.accepted

    def refused(self, peer: bytes) -> bool:
        found = self._peers.get(peer)
        return found is not None and not found.accepted

    def engine(self, peer: bytes) -> bool:
        """An accepted peer that is not an observer: one lookup on every task's path."""
        found = self._peers.get(peer)
        return found is not None and found.accepted and not found.observer

    def observer(self, peer: bytes) -> bool:
        found = self._peers.get(peer)
        return found is not None and found.observer

    def __len__(self) -> int:
        return len(self._peers)

    def _remember(self, peer: bytes, entry: _Peer) -> None:
        self._peers.pop(peer, None)
        self._peers[peer] = entry
        if len(self._peers) <= self.max_peers:
            return
        spare = next((p for p, e in self._peers.items() if not e.accepted or e.observer), None)
        if spare is not None:
            del self._peers[spare]
        else:
            self._peers.popitem(last=False)


class RefusalLog:
    """Warns about refused peers at most once per peer per ``interval_s``, with a count."""

    def __init__(self, who: str, interval_s: float = REFUSAL_LOG_INTERVAL_S) -> None:
        self.who = who
        self.interval_s = interval_s
        self.total = 0
        self._last: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def note(self, peer: str, why: str) -> None:
        self.total += 1
        now = time.monotonic()
        last, count = self._last.pop(peer, (float("-inf"), 0))
        if now - last < self.interval_s:
            self._last[peer] = (last, count + 1)
            return
        self._last[peer] = (now, 0)
        while len(self._last) > MAX_PEERS:
            self._last.popitem(last=False)
        also = f" ({count} more since the last report)" if count else ""
        log.warning("%s: refused %s: %s%s", self.who, peer, why, also)
