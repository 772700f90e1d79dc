"""StoreDirs: a file store's directories, reached only through descriptors from its root.

A store shared on purpose (``permissions: group``) is writable by every member of its group,
and any of them can swap a directory under the root for a symbolic link at any moment. So
below the root nothing is ever opened by path: every operation walks from the root's
descriptor, one component at a time, with ``O_NOFOLLOW | O_DIRECTORY``, and then opens, renames
or unlinks a *name* relative to the directory it reached. A link found where a directory
should be is removed and replaced (never followed); the root itself is the operator's setting,
and is used only where no other user controls it or a directory on the way to it
(``kvtier.common.user_dirs``). Only names the store itself creates are ever unlinked
(``OBJECT_NAME``, ``TMP_NAME``).

Modes are set explicitly with ``fchmod`` on what this user owns, whatever the umask: under the
usual 022 a group store used to get 2750 directories and 0640 files, so other members could
not write.

Where nobody else can rename or replace anything in the root or in ``objects/`` (both this
user's, neither group- nor other-writable: every private store), the 256 fan-out descriptors
are kept open after their first walk instead of walked to on every operation: the walk was four
of a read's nine system calls, each one a GIL hand-off between I/O threads. A kept descriptor
is never closed before ``close()`` (another thread may be using it; a closed number is reused
by the next open); when one turns out removed (``rm -rf`` of the store) every kept one is
retired and the next operation walks again. Directory listings always walk afresh: a listing
moves the descriptor's offset, which threads would share.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import logging
import os
import re
import stat
import threading
from collections.abc import Iterator
from pathlib import Path

from kvtier.common.user_dirs import open_user_directory
from kvtier.errors import ConfigError, StorageError
from kvtier.storage.file.io import alive

log = logging.getLogger("kvtier.storage.file")

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
OBJECTS, TMP = "objects", "tmp"
FANOUT_DIRS = 256
OBJECT_SUFFIX = ".kvb"
OBJECT_NAME = re.compile(r"[0-9a-f]{64}\.kvb")
MAX_PID = 1 << 22  # Linux pid_max limit: a larger "pid" in a temp name is junk
TMP_NAME = re.compile(r"(\d{1,10})-(\d{1,24})-(\d{1,20})\.tmp")
REPLACE_ATTEMPTS = 3


def fanout_name(i: int) -> str:
    return f"{i:02x}"


def _only_mine(fd: int) -> bool:
    """Can only this user (and root) rename or replace entries of the directory ``fd``?"""
    st = os.fstat(fd)
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def set_mode(fd: int, mode: int) -> None:
    """``mode`` on the file or directory ``fd`` if this user owns it (the umask never applies)."""
    st = os.fstat(fd)
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
        os.fchmod(fd, mode)


def real_directory(name: str, dir_fd: int, mode: int, check_mode: bool = False) -> int:
    """A descriptor of the directory ``name`` inside ``dir_fd``, made if missing. Whatever else
    is found at that name (a link, a file, a FIFO) is unlinked first and never followed.
    Several processes may do this at once (ranks sharing a store). The mode is set on a
    directory made here, and with ``check_mode`` on one found (the start-up pass): not on every
    operation's walk."""
    made = False
    for _ in range(REPLACE_ATTEMPTS):
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            try:
                os.mkdir(name, mode, dir_fd=dir_fd)
                made = True
            except FileExistsError:
                pass  # another process made it: open what is there
            continue
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            log.warning("file store: replacing %r (not a directory) with a directory", name)
            # Gone, or a directory again by now (someone racing us): look again.
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                os.unlink(name, dir_fd=dir_fd)
            continue
        if made or check_mode:
            try:
                set_mode(fd, mode)
            except OSError:
                os.close(fd)
                raise
        return fd
    raise StorageError(f"cannot make {name!r} a directory: something keeps replacing it")


class StoreDirs:
    """The root, ``objects/<2 hex>/`` and ``tmp/`` of one store. Thread-safe: every call
    opens what it needs and closes it, except the root's descriptor and, where nobody else can
    swap them, the fan-out descriptors (kept from ``open`` to ``close``)."""

    def __init__(self, root: Path, dir_mode: int) -> None:
        self.root = root
        self.dir_mode = dir_mode
        self.root_fd: int | None = None
        self._lock = threading.Lock()  # replacing root_fd (the root was removed), the cache
        self.keeps_descriptors = False  # set by open(): nobody else can swap our directories
        self._kept: dict[str, int] = {}
        self._retired: list[int] = []

    def open(self) -> StoreDirs:
        """Create what is missing (root included) and check every directory once. A directory
        that someone keeps replacing while we look (a group member racing us) does not stop
        the start: every operation walks to it again, and fails alone if it must."""
        self._open_root()
        assert self.root_fd is not None
        try:
            os.close(real_directory(TMP, self.root_fd, self.dir_mode, check_mode=True))
            objects = real_directory(OBJECTS, self.root_fd, self.dir_mode, check_mode=True)
        except StorageError as e:
            log.warning("file store %s: %s; continuing", self.root, e)
            return self
        try:
            self.keeps_descriptors = all(_only_mine(fd) for fd in (self.root_fd, objects))
            for i in range(FANOUT_DIRS):
                try:
                    fd = real_directory(fanout_name(i), objects, self.dir_mode, check_mode=True)
                except StorageError as e:
                    log.warning("file store %s: %s; continuing", self.root, e)
                    continue
                if self.keeps_descriptors:
                    self._kept[fanout_name(i)] = fd
                else:
                    os.close(fd)
        finally:
            os.close(objects)
        return self

    def _open_root(self) -> None:
        """The root, made where missing; refused (``ConfigError``) where another user controls
        it or a directory on the way to it (``kvtier.common.user_dirs``), before anything in it is
        read or written."""
        shared = bool(self.dir_mode & stat.S_ISGID)  # a group store's documented modes
        fd, created = open_user_directory(
            self.root, self.dir_mode, "storage.root", group_shared=shared
        )
        if created:
            set_mode(fd, self.dir_mode)
        old, self.root_fd = self.root_fd, fd
        if old is not None:
            os.close(old)

    def _below_root(self, name: str) -> int:
        """``real_directory(name)`` in the root; a root that was removed (rm -rf by an
        operator) is made again, once."""
        assert self.root_fd is not None, "StoreDirs.open() first"
        root_fd = self.root_fd
        try:
            return real_directory(name, root_fd, self.dir_mode)
        except FileNotFoundError:  # mkdir inside a deleted directory
            with self._lock:
                if self.root_fd == root_fd:
                    try:
                        self._open_root()
                    except ConfigError as e:  # someone else made it meanwhile: refused
                        raise StorageError(str(e)) from None
            return real_directory(name, self.root_fd, self.dir_mode)

    def close(self) -> None:
        with self._lock:
            kept, self._kept = [*self._kept.values(), *self._retired], {}
            self._retired = []
        for fd in kept:
            os.close(fd)
        if self.root_fd is not None:
            os.close(self.root_fd)
            self.root_fd = None

    @contextlib.contextmanager
    def fanout(self, name: str) -> Iterator[int]:
        """The descriptor of ``objects/<name>`` (made again if it went away or was swapped):
        a kept one where the store keeps them, else one walked to now."""
        if not self.keeps_descriptors:
            with self.walked_fanout(name) as fd:
                yield fd
            return
        kept = self._kept.get(name)
        if kept is not None:
            yield kept
            return
        fd = self._walk_fanout(name)
        with self._lock:
            if name in self._kept:  # another thread kept one meanwhile
                self._retired.append(fd)
                fd = self._kept[name]
            else:
                self._kept[name] = fd
        yield fd

    def touch(self, fan: str, name: str) -> None:
        """Bump the mtime of ``objects/<fan>/<name>``: LRU recency, seen by every process
        sharing the directory; a failure costs only recency."""
        try:
            with self.fanout(fan) as fan_fd:
                os.utime(name, dir_fd=fan_fd, follow_symlinks=False)
        except (OSError, StorageError):
            pass

    @contextlib.contextmanager
    def walked_fanout(self, name: str) -> Iterator[int]:
        """A descriptor of ``objects/<name>`` walked to now, closed after (listings)."""
        fd = self._walk_fanout(name)
        try:
            yield fd
        finally:
            os.close(fd)

    def _walk_fanout(self, name: str) -> int:
        objects = self._below_root(OBJECTS)
        try:
            return real_directory(name, objects, self.dir_mode)
        finally:
            os.close(objects)

    def removed(self, fd: int) -> bool:
        """Was the directory ``fd`` (from ``fanout``) removed (the store deleted under us)?
        Then every kept descriptor is retired, and the next ``fanout`` walks (and makes the
        directories again). Call after an operation in it failed with ENOENT."""
        if not self.keeps_descriptors or os.fstat(fd).st_nlink > 0:
            return False
        with self._lock:
            self._retired += self._kept.values()
            self._kept = {}
        return True

    @contextlib.contextmanager
    def tmp(self) -> Iterator[int]:
        fd = self._below_root(TMP)
        try:
            yield fd
        finally:
            os.close(fd)

    def unlink(self, name: str, dir_fd: int) -> bool:
        """Unlink ``name`` (an object or temporary name of the store, nothing else) in
        ``dir_fd``. False if it was already gone."""
        if not (OBJECT_NAME.fullmatch(name) or TMP_NAME.fullmatch(name)):
            raise StorageError(f"refusing to remove {name!r}: not a name this store creates")
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return False
        return True

    def scan_fanout(self, name: str) -> list[tuple[int, str, int]]:
        """(mtime_ns, name, size) of every regular object file in ``objects/<name>``."""
        found = []
        with self.walked_fanout(name) as fd:
            for entry in os.scandir(fd):
                if not OBJECT_NAME.fullmatch(entry.name):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime_ns, entry.name, st.st_size))
        return found

    def remove_dead_tmp_files(self) -> list[str]:
        """Remove temporary files of writers that died, beside the objects and in the former
        ``tmp/``; any other name (another user's, a link, a live writer's) is left alone.
        Returns the names removed."""
        removed = []
        with self.tmp() as tmp_fd:
            removed += self._remove_dead_tmp_in(tmp_fd)
        for i in range(FANOUT_DIRS):
            with self.walked_fanout(fanout_name(i)) as fd:
                removed += self._remove_dead_tmp_in(fd)
        return removed

    def _remove_dead_tmp_in(self, dir_fd: int) -> list[str]:
        removed = []
        for entry in list(os.scandir(dir_fd)):
            match = TMP_NAME.fullmatch(entry.name)
            if match is None:
                continue
            pid = int(match.group(1))
            if 0 < pid < MAX_PID and alive(pid):
                continue
            if not entry.is_file(follow_symlinks=False):
                continue  # not ours to delete: tolerated, never followed
            if self.unlink(entry.name, dir_fd):
                removed.append(entry.name)
        return removed


def object_name(key: str) -> tuple[str, str]:
    """(fan-out directory, file name) of ``key``'s object."""
    digest = hashlib.sha256(key.encode()).hexdigest()
    return digest[:2], digest + OBJECT_SUFFIX


def tmp_name(counter: itertools.count) -> str:
    """A temporary file name unique to this process and thread (``TMP_NAME``)."""
    return f"{os.getpid()}-{threading.get_ident()}-{next(counter)}.tmp"
