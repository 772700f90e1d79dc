"""Small helpers of the file store: one object read or written in one call, partial writes,
zeroing, liveness, striping over I/O threads, warnings said once."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import xxhash

_fileio: Any = None
try:
    from kvtier import _fileio  # type: ignore[no-redef]
except ImportError:  # built without a C compiler: the Python forms below
    pass

log = logging.getLogger("kvtier.storage.file")

OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class ReadResult(NamedTuple):
    err: int  # 0, or the errno of open / fstat / read (then nothing else is set)
    mode: int  # fstat's st_mode: only a regular file is read
    size: int
    mtime_ns: int
    nread: int  # bytes read into head, body, tail (short: the file ended)
    body_hash: int | None  # XXH3-64 of the bytes read into body; None: not hashed here


def read_object(dir_fd: int, name: str, head, body: Sequence, tail, want_hash: bool) -> ReadResult:
    """Open ``name`` in ``dir_fd`` (never through a link, never waiting on a FIFO), and if it is
    a regular file read ``head``, every buffer of ``body``, then ``tail`` from offset 0 until
    they are full or the file ends; with ``want_hash`` the XXH3-64 of what landed in ``body``
    (or None: the caller hashes — a CPU without AVX2).

    Natively (``kvtier._fileio``) this is one call without the GIL, the body hashed chunk by
    chunk as it arrives; the Python form below does the same steps."""
    if _fileio is not None:
        return ReadResult(*_fileio.read_object(dir_fd, name, head, body, tail, want_hash))
    return read_object_py(dir_fd, name, head, body, tail, want_hash)


def write_object(
    dir_fd: int, name: str, file_mode: int, chmod_mode: int, buffers, sync: bool
) -> int:
    """Create ``name`` in ``dir_fd`` (O_EXCL, never through a link), ``fchmod`` it to
    ``chmod_mode`` unless that is negative, write ``buffers`` in order, ``fdatasync`` with
    ``sync``. Returns 0 or the first errno; a file left after an error is the caller's to
    remove."""
    if _fileio is not None:
        return int(_fileio.write_object(dir_fd, name, file_mode, chmod_mode, list(buffers), sync))
    return write_object_py(dir_fd, name, file_mode, chmod_mode, buffers, sync)


def write_new(dir_fd: int, name: str, mode: int, buffers, sync: bool) -> None:
    """``write_object`` of a new file of ``mode`` (set explicitly when it grants more than the
    owner's rw: group stores get 0660 whatever the umask); raises OSError."""
    err = write_object(dir_fd, name, mode, mode if mode & ~0o600 else -1, buffers, sync)
    if err:
        raise OSError(err, os.strerror(err), name)


def read_object_py(dir_fd, name, head, body, tail, want_hash) -> ReadResult:
    try:
        fd = os.open(name, OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        return ReadResult(e.errno or errno.EIO, 0, 0, 0, 0, None)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return ReadResult(0, st.st_mode, st.st_size, st.st_mtime_ns, 0, None)
        buffers = [b for b in (head, *body, tail) if b is not None]
        total = sum(memoryview(b).nbytes for b in buffers)
        nread = 0
        while nread < total:
            n = os.preadv(fd, advance(buffers, nread), nread)
            if n == 0:
                break
            nread += n
    except OSError as e:
        return ReadResult(e.errno or errno.EIO, 0, 0, 0, 0, None)
    finally:
        os.close(fd)
    digest = None
    if want_hash:
        state = xxhash.xxh3_64()
        left = nread - (memoryview(head).nbytes if head is not None else 0)
        for view in body:
            view = memoryview(view).cast("B")
            state.update(view[: max(0, left)])
            left -= len(view)
        digest = state.intdigest()
    return ReadResult(0, st.st_mode, st.st_size, st.st_mtime_ns, nread, digest)


def write_object_py(dir_fd, name, file_mode, chmod_mode, buffers, sync) -> int:
    try:
        fd = os.open(name, CREATE_FLAGS, file_mode, dir_fd=dir_fd)
    except OSError as e:
        return e.errno or errno.EIO
    try:
        if chmod_mode >= 0:
            os.fchmod(fd, chmod_mode)
        buffers = list(buffers)
        written, total = 0, sum(memoryview(b).nbytes for b in buffers)
        while written < total:
            n = os.pwritev(fd, buffers, written)
            if n <= 0:
                return errno.EIO
            written += n
            buffers = advance(buffers, n)
        if sync:
            os.fdatasync(fd)
    except OSError as e:
        return e.errno or errno.EIO
    finally:
        os.close(fd)
    return 0


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


def striped_async(
    pool: ThreadPoolExecutor,
    threads: int,
    fn: Callable[[int, str, Any], bool],
    keys: Sequence[str],
    blocks: Sequence,
    done: Callable[[list[bool], BaseException | None], None],
) -> None:
    """``striped``'s work on ``pool`` (one task per thread, ``threads`` at most), returning at
    once: the task that finishes last calls ``done(results, error)`` exactly once,
    ``error`` the first exception a task raised (its later keys stay False). Raises only when
    no task could be queued (a pool shut down): then ``done`` is never called."""
    n = len(keys)
    results: list[bool] = [False] * n
    workers = max(1, min(threads, n))
    left = [workers]
    errors: list[BaseException] = []
    lock = threading.Lock()

    def finished(count: int) -> None:
        with lock:
            left[0] -= count
            last = left[0] == 0
        if last:
            try:
                done(results, errors[0] if errors else None)
            except Exception:  # the caller's answer failed: nothing here can answer instead
                log.exception("file store: a transfer's completion failed")
            finally:
                # An error's traceback holds the stripes' frames, and through them the callers'
                # buffers: a cycle, kept until a collection (vLLM's region cannot unmap then).
                errors.clear()

    def run(stripe: int) -> None:
        try:
            for i in range(stripe, n, workers):
                results[i] = fn(i, keys[i], blocks[i])
        except Exception as e:
            errors.append(e)
        finished(1)

    for stripe in range(workers):
        try:
            pool.submit(run, stripe)
        except RuntimeError as e:  # shut down meanwhile
            if not stripe:
                raise
            errors.append(e)
            finished(workers - stripe)
            return


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


def key_trailer(fd: int, object_bytes: int, max_bytes: int) -> str | None:
    """The text ending the object open at ``fd`` (closed here): its storage key, if it is one
    of ours (the caller checks that it names the object)."""
    try:
        return os.pread(fd, max_bytes, object_bytes).decode()
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)


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
    used it (a worker's background save thread: the store's writes stay background work).
    Once shut down it makes none again (``get`` raises RuntimeError, as a pool shut down
    refuses work)."""

    def __init__(self, threads: int, name: str) -> None:
        self.threads, self.name = threads, name
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    def get(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: shut down")
            if self._pool is None:
                nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
                self._pool = ThreadPoolExecutor(
                    self.threads, self.name, initializer=_at_priority, initargs=(nice,)
                )
            return self._pool

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def _at_priority(nice: int) -> None:
    """Thread initializer: run at ``nice`` (a thread may always lower its own priority)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except OSError:
        pass
