"""Rank: what a Client knows of one worker, and when it gives up on it (a typed loss)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import PeerNotVerified, WorkerError

EXIT_GRACE_S = 0.2  # after a worker process exits, its last answers are still read this long
# Failed CURVE handshakes with a rank not yet welcomed before its start fails: the peer on the
# port answers but cannot prove it holds the secret. (ZeroMQ reconnects within 0.1 s; a worker
# still starting refuses connections, which is no failed handshake.)
HANDSHAKE_FAILURES_TO_FAIL = 3

# Why, what Client.start raises for it, and whether the rank may come back: a worker that only
# fell silent (a stalled process on an overloaded machine) is welcomed back when it answers a
# hello again from the same process; one that exited or failed to authenticate is not.
Loss = tuple[str, type[WorkerError], bool]


@dataclass
class Rank:
    """One worker as its client sees it. Mutated by the client's I/O thread only; ``lost``
    and ``welcomed`` are read under the client's ready condition."""

    position: int
    endpoint: str
    process: subprocess.Popen | None = None
    last_heard: float = 0.0
    welcomed: bool = False
    lost: str = ""
    lost_error: type[WorkerError] = WorkerError
    recoverable: bool = False  # lost by silence only: a welcome from ``pid`` restores it
    lost_at: float = 0.0
    pid: int = 0  # the worker process that first welcomed this client
    exited_at: float = 0.0
    last_hello: float = 0.0
    # Its running save's (blocks, seconds blocked on the store, when heard): Heartbeat
    save_blocked: tuple[int, float, float] = (0, 0.0, 0.0)

    def check(self, now: float, failed_handshakes: int, worker_timeout_s: float) -> Loss | None:
        """Why this rank is lost now, if it is: its process exited (after a grace period for
        its last answers), its peer failed to authenticate, or it fell silent once welcomed."""
        code = self.process.poll() if self.process is not None else None
        if self.lost:
            if code is not None:
                self.recoverable = False  # a silent worker that then exited stays lost
            return None
        if code is not None:
            self.exited_at = self.exited_at or now
            if now - self.exited_at >= EXIT_GRACE_S:
                return f"worker process exited with code {code}", WorkerError, False
        elif not self.welcomed and failed_handshakes >= HANDSHAKE_FAILURES_TO_FAIL:
            return (
                f"the peer on {self.endpoint} failed the CURVE handshake: it does not prove it "
                "holds this instance's secret — a worker started with another auth_key_file, "
                "or a possible impostor listening on the endpoint",
                PeerNotVerified,
                False,
            )
        elif self.welcomed and now - self.last_heard > worker_timeout_s:
            return (
                f"no answer for {now - self.last_heard:.1f} s "
                f"(worker_timeout_s={worker_timeout_s})",
                WorkerError,
                True,
            )
        return None

    def may_come_back(self, pid: int) -> bool:
        """A welcome from ``pid`` restores this lost rank: it was lost by silence only, and the
        same worker process answers (a new process at the endpoint is not the one we knew)."""
        return bool(self.lost) and self.recoverable and pid == self.pid


def blocked_save(ranks: Sequence[Rank], fresh_s: float) -> tuple[int, float] | None:
    """(blocks, seconds) of the save blocked longest on its store over ``ranks``, as their
    heartbeats of the last ``fresh_s`` seconds tell (``Heartbeat.save_blocked_s``); None when
    no save is."""
    since = time.monotonic() - fresh_s
    reports = [r.save_blocked for r in ranks if r.save_blocked[2] >= since]
    blocks, seconds, _ = max(reports, key=lambda rep: rep[1], default=(0, 0.0, 0.0))
    return (blocks, seconds) if blocks > 0 and seconds > 0 else None
