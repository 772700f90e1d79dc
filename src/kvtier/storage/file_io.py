"""Small file-system helpers of the file store: partial writes, zeroing, liveness."""

from __future__ import annotations

import logging
import os

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
