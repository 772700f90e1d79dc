"""What dead launchers and workers leave, found by their free locks, and removed.

Every kvtier file that outlives a crash is held by a lock while its owner lives: shared-memory
files (``kvtier.memory.shm``), workers' sockets (``<socket>.lock``), launch directories
(``.owner.lock``). A file whose lock can be taken belongs to a process that died; every start
of a launch, a worker that lost its engine, and a reaper sweep them with ``reclaim_orphans``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

from kvtier.memory import shm
from kvtier.transport.endpoint import reclaim_sockets
from kvtier.worker.config import default_socket_dir

log = logging.getLogger(__name__)

LAUNCH_DIR_PREFIX = "kvtier-launch-"
OWNER_LOCK = ".owner.lock"


def reclaim_orphans() -> None:
    """Remove what launchers and workers that died left: shm files, sockets, launch dirs."""
    shm.reclaim_orphans()
    try:
        reclaim_sockets(default_socket_dir())
    except Exception as e:  # never stop a launch over housekeeping
        log.debug("socket sweep skipped: %s", e)
    reclaim_launch_dirs(Path(tempfile.gettempdir()))


def reclaim_launch_dirs(directory: Path) -> list[str]:
    """Remove this user's launch directories whose launcher is provably dead (lock free)."""
    removed: list[str] = []
    try:
        entries = [p for p in directory.iterdir() if p.name.startswith(LAUNCH_DIR_PREFIX)]
    except OSError:
        return removed
    for path in entries:
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
                continue
            fd = os.open(path / OWNER_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its launcher lives
        finally:
            os.close(fd)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    if removed:
        log.warning("removed %d launch directories of engines that died", len(removed))
    return removed
