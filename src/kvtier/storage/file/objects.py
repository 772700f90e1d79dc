"""The file store's objects as files: each one reached through its fan-out directory's
descriptor (``file_dirs``), never through a link, and written whole or not at all.

- ``open`` / ``read``: a regular file only — a missing object, or junk planted in its place (a
  FIFO, a directory, a link), is no object: never followed, never waited on.
- ``publish``: a temporary file beside the object, then ``rename()`` within that directory: a
  crash at any point leaves no object or the whole object.
- ``remove``: unlinked through the directory descriptor.

What an object holds (header, payload, key trailer) and whether it is sound is the store's
(``kvtier.storage.file.store``); failures to reach a file are said once per kind (``OnceLog``).
"""

from __future__ import annotations

import errno
import itertools
import os
import stat

from kvtier.errors import StorageError
from kvtier.storage.file.config import FileStoreConfig, FsyncPolicy
from kvtier.storage.file.dirs import StoreDirs, object_name, tmp_name
from kvtier.storage.file.io import (
    OPEN_FLAGS,
    OnceLog,
    ReadResult,
    key_trailer,
    read_object,
    write_new,
)

MAX_KEY_BYTES = 4096  # a storage key trailer is far shorter: a longer object is not ours


class ObjectFiles:
    """The object files under one store's ``objects/`` directories."""

    def __init__(self, dirs: StoreDirs, config: FileStoreConfig, warn_once: OnceLog) -> None:
        self._dirs, self.config, self._warn_once = dirs, config, warn_once
        self._tmp_counter = itertools.count()

    def open(self, fan: str, name: str) -> int | None:
        """A descriptor of the object ``objects/<fan>/<name>``; None if there is none (or only
        junk: a FIFO, a directory, a link — never followed, never waited on)."""
        try:
            with self._dirs.fanout(fan) as fan_fd:
                fd = os.open(name, OPEN_FLAGS, dir_fd=fan_fd)
        except FileNotFoundError:
            return None
        except (OSError, StorageError) as e:
            if not isinstance(e, OSError) or e.errno not in (errno.ELOOP, errno.ENXIO):
                self._warn_once("read", e)
            return None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return fd

    def key_of(self, name: str, object_bytes: int) -> str | None:
        """The storage key in object ``name``'s trailer (after ``object_bytes``), if it names
        that object."""
        fd = self.open(name[:2], name)
        key = None if fd is None else key_trailer(fd, object_bytes, MAX_KEY_BYTES)
        return key if key is not None and object_name(key)[1] == name else None

    def read(self, fan: str, name: str, head, body, tail, want_hash: bool) -> ReadResult | None:
        """``file_io.read_object`` of ``objects/<fan>/<name>``; None if there is no regular
        file (a missing object, or junk) or it could not be read (said once)."""
        try:
            with self._dirs.fanout(fan) as fan_fd:
                found = read_object(fan_fd, name, head, body, tail, want_hash)
                if found.err == errno.ENOENT and self._dirs.removed(fan_fd):
                    with self._dirs.fanout(fan) as fresh_fd:  # the store was deleted: again
                        found = read_object(fresh_fd, name, head, body, tail, want_hash)
        except FileNotFoundError:
            return None
        except (OSError, StorageError) as e:
            self._warn_once("read", e)
            return None
        if found.err:
            if found.err not in (errno.ENOENT, errno.ELOOP, errno.ENXIO):
                self._warn_once("read", OSError(found.err, os.strerror(found.err)))
            return None
        return found if stat.S_ISREG(found.mode) else None

    def publish(self, fan: str, name: str, buffers: list) -> None:
        """Write ``buffers`` to a temporary file in ``objects/<fan>`` and rename it ``name``
        (an object already there stays until the rename replaces it whole)."""
        tmp = tmp_name(self._tmp_counter)
        with self._dirs.fanout(fan) as fan_fd:
            try:
                self._write_tmp(tmp, fan_fd, buffers)
                os.rename(tmp, name, src_dir_fd=fan_fd, dst_dir_fd=fan_fd)
                if self.config.fsync is FsyncPolicy.FULL:
                    os.fsync(fan_fd)
            except FileNotFoundError:
                self._dirs.removed(fan_fd)  # retires the kept descriptors if so
                raise
            except BaseException:
                self._dirs.unlink(tmp, fan_fd)
                raise

    def replace(self, fan: str, name: str, data: bytes) -> None:
        """``data`` as object ``name``, whatever it held (fault injection, tools); errors
        raised."""
        tmp = tmp_name(self._tmp_counter)
        with self._dirs.fanout(fan) as fan_fd:
            self._write_tmp(tmp, fan_fd, [data])
            os.replace(tmp, name, src_dir_fd=fan_fd, dst_dir_fd=fan_fd)

    def remove(self, fan: str, name: str) -> bool:
        """Unlink object ``name``: True if it was there (a failure is said once: False)."""
        try:
            with self._dirs.fanout(fan) as fan_fd:
                return self._dirs.unlink(name, fan_fd)
        except (OSError, StorageError) as e:
            self._warn_once("remove", e)
            return False

    def _write_tmp(self, tmp: str, tmp_fd: int, buffers: list) -> None:
        sync = self.config.fsync is not FsyncPolicy.NONE
        write_new(tmp_fd, tmp, self.config.permissions.file_mode, buffers, sync)
