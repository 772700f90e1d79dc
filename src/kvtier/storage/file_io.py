"""Small file-system helpers of the file store: partial writes, page cache, liveness, dirs."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from kvtier.errors import StorageError

log = logging.getLogger("kvtier.storage.file")


def zero(views) -> None:
    for view in views:
        view[:] = bytes(len(view))


def real_directory(path: Path, mode: int) -> None:
    """Make ``path`` a directory of its own: a link or a file found there is removed first.
    Several processes may do this at once (ranks sharing a store)."""
    for _ in range(3):
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            try:
                os.mkdir(path, mode)
                return
            except FileExistsError:
                continue  # another process made it: check what it is
        if stat.S_ISDIR(st.st_mode):
            return
        log.warning("file store: replacing %s (not a directory) with a directory", path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    raise StorageError(f"cannot make {path} a directory: something keeps replacing it")


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


def drop_page_cache(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
