"""EndpointClaim: one live worker per endpoint, and no socket files left by the dead.

A worker holds an exclusive ``flock`` on ``<socket>.lock`` (0600, in the private socket
directory) for its whole life. A second worker on the same ``ipc://`` path is refused while the
first lives, instead of silently taking the path over; a socket whose lock can be taken was left
by a worker that died, and ``reclaim_sockets`` removes it at the next start.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
from pathlib import Path

from kvtier.errors import WorkerError

log = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"


class EndpointClaim:
    def __init__(self, address: str) -> None:
        self.address = address
        self.path = Path(address[len("ipc://") :]) if address.startswith("ipc://") else None
        self._fd: int | None = None

    def acquire(self) -> EndpointClaim:
        if self.path is None:
            return self  # tcp: the bind itself fails while the port is in use
        lock = self.path.with_name(self.path.name + LOCK_SUFFIX)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise WorkerError(
                    f"{lock} is not a lock file of this user: refusing {self.address}"
                )
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise WorkerError(
                f"{self.address} is in use by a running worker: stop it, or use another "
                "instance id or endpoint"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        _unlink_socket(self.path)  # left by a worker that died: ours to replace
        return self

    def release(self) -> None:
        if self._fd is None or self.path is None:
            return
        _unlink_socket(self.path)
        try:
            os.unlink(self.path.with_name(self.path.name + LOCK_SUFFIX))
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None


def _unlink_socket(path: Path) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid():
        os.unlink(path)


def reclaim_sockets(directory: Path) -> list[str]:
    """Remove sockets (and their locks) in ``directory`` whose workers are provably dead."""
    removed: list[str] = []
    try:
        locks = [p for p in directory.iterdir() if p.name.endswith(".sock" + LOCK_SUFFIX)]
    except OSError:
        return removed
    for lock in locks:
        if _reclaim(lock):
            removed.append(lock.name[: -len(LOCK_SUFFIX)])
    if removed:
        log.warning("removed %d socket(s) of workers that died: %s", len(removed), removed[:5])
    return removed


def reclaim_endpoint(address: str) -> bool:
    """Remove an ``ipc://`` worker's socket and lock if no live worker holds them (a worker
    that was killed); True when removed. Another live worker's are never touched."""
    if not address.startswith("ipc://"):
        return False
    path = Path(address[len("ipc://") :])
    return _reclaim(path.with_name(path.name + LOCK_SUFFIX))


def _reclaim(lock: Path) -> bool:
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live worker
        _unlink_socket(lock.with_name(lock.name[: -len(LOCK_SUFFIX)]))
        os.unlink(lock)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
