"""Named shared-memory files: create them locked, open them safely, reclaim what the dead left.

Every file kvtier publishes under a name (a CPU device cache, CUDA IPC handles, a shared host
pool) lives in ``SHM_DIR`` as ``kvtier-<name>.<kind>`` and is held by its owner with an
exclusive ``flock`` for the owner's whole life. That one rule gives three guarantees:

- a file is visible under its name only once it is locked (it is created under a temporary
  name, locked, then hard-linked into place), so a file whose lock can be taken belongs to an
  owner that is provably dead;
- ``reclaim_orphans`` removes such files (and dead creators' temporary files) at the next kvtier
  start on the machine, so crashes do not pile up in /dev/shm;
- ``open_checked`` opens by name without following links and checks the opened descriptor:
  a regular file, owned by this user, with no group or other access. Nothing another local user
  planted is ever mapped, and a checked descriptor is mapped as it is, never re-opened by path.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import mmap
import os
import re
import secrets
import stat
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.errors import DeviceCacheError, UnsafeFile

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
FILE_MODE = 0o600
NAME_PREFIX = "kvtier-"
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_CREATING_SUFFIX = ".creating"
CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_counter = itertools.count()


class SegmentKind(str, Enum):
    """What a named file holds; the suffix keeps kinds apart, so one never shadows another."""

    CPU_CACHE = "kvcache"
    CUDA_HANDLES = "cudaipc"


def check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise DeviceCacheError(
            f"name {name!r} must be 1-200 characters of letters, digits, '.', '_', '-'"
        )


def segment_path(name: str, kind: SegmentKind, directory: Path | None = None) -> Path:
    check_name(name)
    return (directory or SHM_DIR) / f"{name}.{kind.value}"


# ---- creating ---------------------------------------------------------------------------------


def create_locked(path: Path, what: str) -> int:
    """Create ``path`` (mode 0600) and hold an exclusive flock on it; return the descriptor.

    The file appears under ``path`` already locked. A file left there by a dead owner (its lock
    can be taken) is reclaimed with one WARNING; a live owner's file raises DeviceCacheError.
    """
    for _ in range(3):
        tmp = path.with_name(f".{path.name}.{_unguessable()}{_CREATING_SUFFIX}")
        try:
            fd = os.open(
                tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
            )
        except FileExistsError:  # planted there by someone else (or a link): another name
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.link(tmp, path)
                return fd
            except FileExistsError:
                pass
            except (BlockingIOError, FileNotFoundError):
                # Another process's reclaim_orphans found the temporary file before its lock
                # was taken, took that lock and removed it: a fresh temporary file, again.
                os.close(fd)
                continue
        except BaseException:
            os.close(fd)
            raise
        finally:
            unlink_quietly(tmp)
        os.close(fd)
        holder = _reclaim(path)
        if holder is _Holder.FOREIGN:
            raise UnsafeFile(
                f"{path} exists and is not a file of this user: refusing to use {what}; "
                "remove it or choose another name"
            )
        if holder is _Holder.LIVE:
            raise DeviceCacheError(
                f"{what} is owned by a running process ({path}); "
                "use another instance id or stop that process"
            )
        log.warning("reclaimed %s left by a crashed owner (%s)", what, path)
    raise DeviceCacheError(
        f"could not create {path}: another process keeps re-creating it or the temporary "
        f"names beside it ({path.parent}/.{path.name}.*{_CREATING_SUFFIX}); find and stop it"
    )


def _unguessable() -> str:
    """This process's part of a temporary name: pid, a count and 64 random bits, so that
    nobody can plant a file at the name before it is made."""
    return f"{os.getpid()}-{next(_counter)}-{secrets.token_hex(8)}"


def reserve(fd: int, size_bytes: int, what: str) -> None:
    """Give the file ``size_bytes`` of real pages now, or fail with a clear error.

    On tmpfs a sparse file that outgrows free memory kills its users with SIGBUS at the first
    touch; ``posix_fallocate`` turns that into ENOSPC here, before anything is mapped.
    """
    try:
        os.posix_fallocate(fd, 0, size_bytes)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise DeviceCacheError(
                f"{what} needs {size_bytes / 2**30:.2f} GiB of shared memory but "
                f"{SHM_DIR} has {free_bytes(SHM_DIR) / 2**30:.2f} GiB free: "
                "use fewer blocks or free /dev/shm"
            ) from None
        raise


def check_space(size_bytes: int, what: str) -> None:
    """DeviceCacheError when ``size_bytes`` cannot fit in /dev/shm's free space now."""
    free = free_bytes(SHM_DIR)
    if size_bytes > free:
        raise DeviceCacheError(
            f"{what} needs {size_bytes / 2**30:.2f} GiB of shared memory but {SHM_DIR} has "
            f"{free / 2**30:.2f} GiB free: use fewer blocks or free /dev/shm"
        )


def free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


# ---- opening ----------------------------------------------------------------------------------


def open_checked(path: Path, what: str, *, writable: bool = True) -> int:
    """Open ``path`` without following links and check the descriptor; return it.

    Raises DeviceCacheError when the file does not exist and UnsafeFile when it is not a regular
    file, belongs to another user, or grants any group/other permission.
    """
    flags = (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags | os.O_CLOEXEC)
    except FileNotFoundError:
        raise DeviceCacheError(f"no {what} at {path}") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFile(f"{what} {path} is a symbolic link: refused") from None
        raise DeviceCacheError(f"cannot open {what} {path}: {e}") from None
    try:
        check_descriptor(fd, path, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_descriptor(fd: int, path: Path, what: str) -> os.stat_result:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeFile(f"{what} {path} is not a regular file: refused")
    if st.st_uid != os.geteuid():
        raise UnsafeFile(
            f"{what} {path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}): refused"
        )
    if st.st_mode & 0o077:
        raise UnsafeFile(
            f"{what} {path} has mode {stat.S_IMODE(st.st_mode):o}; kvtier files are 0600: refused"
        )
    return st


def owner_alive(fd: int) -> bool:
    """True while the file's owner holds its exclusive lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def map_descriptor(fd: int, size_bytes: int) -> torch.Tensor:
    """A writable uint8 tensor over the first ``size_bytes`` of an open file (MAP_SHARED).

    The mapping lives as long as the tensor or any view of it; the descriptor may be closed.
    Its page tables are populated now (MAP_POPULATE): a process that attaches a cache another
    one filled would otherwise take a page fault per 4 KiB on its first copy into each block
    (measured: a 60 MiB load into a freshly attached cache ran at half speed).
    """
    import torch

    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    mapping = mmap.mmap(fd, size_bytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


# ---- reclaiming -------------------------------------------------------------------------------


class _Holder(str, Enum):
    NONE = "none"  # gone, or reclaimed now
    LIVE = "live"  # a live owner holds the lock
    FOREIGN = "foreign"  # not a regular file of this user: never touched


def _reclaim(path: Path) -> _Holder:
    """Unlink ``path`` if it is ours and its owner is dead."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return _Holder.NONE
    except OSError:
        return _Holder.FOREIGN
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return _Holder.FOREIGN
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return _Holder.LIVE
        try:
            current = os.lstat(path)
        except FileNotFoundError:
            return _Holder.NONE
        if (current.st_ino, current.st_dev) == (st.st_ino, st.st_dev):
            unlink_quietly(path)
        return _Holder.NONE
    finally:
        os.close(fd)


def reclaim_orphans(directory: Path | None = None) -> list[str]:
    """Remove kvtier files in ``directory`` (default SHM_DIR) whose owners are dead.

    Only this user's regular files named ``kvtier-*`` with a kvtier suffix (or a dead creator's
    temporary file) are considered, and only when their lock can be taken. Returns the names.
    """
    directory = directory or SHM_DIR
    suffixes = tuple(f".{k.value}" for k in SegmentKind)
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        ours = name.startswith(NAME_PREFIX) and name.endswith(suffixes)
        creating = name.startswith("." + NAME_PREFIX) and name.endswith(_CREATING_SUFFIX)
        if not (ours or creating):
            continue
        path = Path(directory) / name
        if path.exists() and _reclaim(path) is _Holder.NONE:
            removed.append(name)
    if removed:
        log.warning(
            "removed %d kvtier file(s) left in %s by processes that died: %s",
            len(removed),
            directory,
            ", ".join(sorted(removed)[:5]) + (" ..." if len(removed) > 5 else ""),
        )
    return removed
