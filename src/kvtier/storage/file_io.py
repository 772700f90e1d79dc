"""Small helpers of the file store: partial writes, zeroing, liveness, striping over I/O
threads, warnings said once."""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

log = logging.getLogger("kvtier.storage.file")


def zero(views) -> None:
    for view in views:
        view[:] = bytes(len(view))


def advance(buffers: list, n: int) -> list:
    """Drop the first n bytes from a list of buffers (after a partial pwritev)."""
    out = []
    for buf in buffers:
        view = memoryview(buf).cast("B")
        if n >= len(view):
            n -= len(view)
            continue
        out.append(view[n:])
        n = 0
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def striped(
    pool: ThreadPoolExecutor | None,
    threads: int,
    fn: Callable[[int, str, Any], bool],
    keys: Sequence[str],
    blocks: Sequence,
    prefix: bool = False,
) -> list[bool]:
    """``fn(i, key, block)`` for every key: inline without a ``pool`` (or for one key), else
    one task per thread, each taking every ``threads``-th key (not one task per key).

    ``prefix``: the caller uses only the leading run of True, so keys after the first False are
    not run (False without a call) — inline, none of them; on threads, none that starts after
    the False is known (one another thread had begun still completes)."""
    n = len(keys)
    results: list[bool] = [False] * n
    first_false = [n]

    def one(i: int) -> None:
        if prefix and i > first_false[0]:
            return
        results[i] = fn(i, keys[i], blocks[i])
        if not results[i]:
            first_false[0] = min(first_false[0], i)

    if pool is None or n < 2:
        for i in range(n):
            one(i)
        return results
    workers = min(threads, n)

    def run(stripe: int) -> None:
        for i in range(stripe, n, workers):
            one(i)

    for future in [pool.submit(run, s) for s in range(workers)]:
        future.result()
    return results


class OnceLog:
    """One warning per (operation, errno): a full disk must not flood the log."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._seen: set[tuple[str, int]] = set()

    def __call__(self, operation: str, error: Exception) -> None:
        token = (operation, getattr(error, "errno", None) or 0)
        if token not in self._seen:
            self._seen.add(token)
            log.warning(
                "%s: %s failed: %s (further such errors are not logged)",
                self.what,
                operation,
                error,
            )


def warn_if_open(root: Path, permissions: Any) -> None:
    """A private store whose root group or other may enter holds users' prompts in the open."""
    st = os.stat(root)
    if permissions.value == "private" and st.st_mode & 0o077:
        log.warning(
            "file store %s is open to group/other (mode %o): stored KV holds users' prompts; "
            "chmod 700 it, or set storage.permissions: group for a store shared on purpose",
            root,
            stat.S_IMODE(st.st_mode),
        )


class CallersPriorityPool:
    """A thread pool made on first use, its threads at the priority of the thread that first
    used it (a worker's background save thread: the store's writes stay background work)."""

    def __init__(self, threads: int, name: str) -> None:
        self.threads, self.name = threads, name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
                self._pool = ThreadPoolExecutor(
                    self.threads, self.name, initializer=_at_priority, initargs=(nice,)
                )
            return self._pool

    def shutdown(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def _at_priority(nice: int) -> None:
    """Thread initializer: run at ``nice`` (a thread may always lower its own priority)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        pass
