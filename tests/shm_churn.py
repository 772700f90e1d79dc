"""Another program using /dev/shm the way kvtier does: creates and removes kvtier-named files
(device caches, CUDA handle files, temporary names) all the time, some held locked, some left
for the next start to reclaim. .ci/run runs the process tests beside it: a test may look only at
names it made itself.

    python tests/shm_churn.py [SECONDS]     (default: until killed)
"""

from __future__ import annotations

import fcntl
import os
import random
import signal
import sys
import time
import uuid

SHM = "/dev/shm"
SUFFIXES = (".kvcache", ".cudaipc")


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leave nothing when stopped
    end = time.monotonic() + float(sys.argv[1]) if len(sys.argv) > 1 else float("inf")
    made: list[tuple[str, int | None]] = []  # (path, the descriptor holding its lock)
    rng = random.Random(os.getpid())
    try:
        while time.monotonic() < end:
            name = f"kvtier-churn{uuid.uuid4().hex[:8]}-rank{rng.randrange(4)}-dev0"
            path = os.path.join(SHM, name + rng.choice(SUFFIXES))
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, 4096 * rng.randrange(1, 16))
            if rng.random() < 0.5:
                fcntl.flock(fd, fcntl.LOCK_EX)  # a live owner: nobody may reclaim it
                made.append((path, fd))
            else:
                os.close(fd)  # a dead owner's file: a kvtier start may reclaim it
                made.append((path, None))
            while len(made) > 24:
                _remove(*made.pop(0))
            time.sleep(0.05)
    finally:
        for path, fd in made:
            _remove(path, fd)


def _remove(path: str, fd: int | None) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # reclaimed by a kvtier start: what the churn is for
    if fd is not None:
        os.close(fd)


if __name__ == "__main__":
    main()
