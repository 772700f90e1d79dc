"""One file-store object read or written in one call: the native form (``kvtier._fileio``) and
the Python form the store uses without it do the same thing, on the same files."""

from __future__ import annotations

import errno
import os
import stat

import pytest
import torch
import xxhash

from conftest import require_native
from kvtier.storage.file import io as file_io


@pytest.fixture(params=["native", "python"])
def io(request):
    """The native reads and writes (``kvtier._fileio``) and their pure-Python fallback."""
    if request.param == "native":
        native = require_native("kvtier._fileio")
        read, write = native.read_object, native.write_object
    else:
        read, write = file_io.read_object_py, file_io.write_object_py
    return lambda *a: file_io.ReadResult(*read(*a)), write


@pytest.fixture
def directory(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield tmp_path, fd
    os.close(fd)


def _payload(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def test_an_object_written_reads_back_equal_with_the_hash_of_its_body(io, directory) -> None:
    read, write = io
    root, fd = directory
    body = _payload(3 << 20)  # several read chunks
    head, tail = os.urandom(64), b"the key"
    assert write(fd, "obj", 0o600, -1, [head, memoryview(body.numpy()), tail], False) == 0
    out_head, out_tail = bytearray(64), bytearray(len(tail))
    out = torch.zeros_like(body)
    found = read(fd, "obj", out_head, [memoryview(out.numpy())], out_tail, True)
    assert found.err == 0 and stat.S_ISREG(found.mode)
    assert found.size == found.nread == 64 + body.numel() + len(tail)
    assert bytes(out_head) == head and bytes(out_tail) == tail and torch.equal(out, body)
    assert found.body_hash in (None, xxhash.xxh3_64_intdigest(body.numpy()))
    assert found.mtime_ns == os.stat(root / "obj").st_mtime_ns
    assert read(fd, "obj", out_head, [memoryview(out.numpy())], out_tail, False).body_hash is None


def test_a_body_in_pieces_hashes_as_the_whole_and_a_short_file_reads_short(io, directory) -> None:
    read, write = io
    root, fd = directory
    body = _payload(1 << 20, 1)
    assert write(fd, "obj", 0o600, -1, [bytes(64), memoryview(body.numpy())], False) == 0
    pieces = [bytearray(1000), bytearray((1 << 20) - 1000)]
    found = read(fd, "obj", bytearray(64), pieces, bytearray(10), True)
    assert found.nread == 64 + (1 << 20) and b"".join(pieces) == body.numpy().tobytes()
    assert found.body_hash in (None, xxhash.xxh3_64_intdigest(body.numpy()))
    os.truncate(root / "obj", 5000)
    found = read(fd, "obj", bytearray(64), pieces, None, True)
    assert found.err == 0 and found.size == found.nread == 5000


def test_what_is_not_a_regular_file_is_never_followed_or_waited_on(io, directory) -> None:
    read, write = io
    root, fd = directory
    (root / "target").write_bytes(b"x" * 100)
    os.symlink(root / "target", root / "link")
    os.mkfifo(root / "fifo")  # a blocking open would hang here
    (root / "dir").mkdir()
    buffers = (bytearray(64), [bytearray(36)], None, True)
    assert read(fd, "link", *buffers).err == errno.ELOOP
    assert read(fd, "missing", *buffers).err == errno.ENOENT
    for name in ("fifo", "dir"):
        found = read(fd, name, *buffers)
        assert not stat.S_ISREG(found.mode) and found.nread == 0, name
    assert write(fd, "link", 0o600, -1, [b"y"], False) == errno.EEXIST  # O_EXCL, not through it
    assert (root / "target").read_bytes() == b"x" * 100


def test_a_write_sets_the_mode_asked_whatever_the_umask(io, directory) -> None:
    _, write = io
    root, fd = directory
    old = os.umask(0o077)
    try:
        assert write(fd, "group", 0o660, 0o660, [b"abc"], True) == 0
        assert write(fd, "private", 0o600, -1, [b"abc"], False) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(root / "group").st_mode) == 0o660
    assert stat.S_IMODE(os.stat(root / "private").st_mode) == 0o600
    assert write(fd, "private", 0o600, -1, [b"abc"], False) == errno.EEXIST


def test_bad_arguments_are_errors_not_crashes() -> None:
    require_native("kvtier._fileio")
    with pytest.raises(BufferError):  # nothing is read into read-only memory
        file_io._fileio.read_object(0, "x", b"read-only", [], None, False)
    with pytest.raises(TypeError):
        file_io._fileio.read_object(0, "x", None, 5, None, False)
    with pytest.raises(ValueError):
        file_io._fileio.read_object(0, "x", None, [bytearray(1)] * 5000, None, False)


def test_striped_async_answers_once_from_the_last_stripe_whatever_fails(caplog) -> None:
    """A started read's stripes (``striped_async``): every key's result lands in its place and
    ``done`` is called exactly once, off the caller's thread, after every stripe; a stripe that
    raises ends only its own keys (False) and hands its error to ``done``; a ``done`` that
    raises is logged; a pool already shut down refuses the read at once,
    and ``done`` is never called."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    keys = [f"k{i}" for i in range(10)]
    with ThreadPoolExecutor(4) as pool:
        for threads, failing in ((4, None), (1, None), (4, 5), (3, 0)):
            calls: list[tuple] = []
            answered = threading.Event()

            def fn(i: int, key: str, block: object, failing=failing) -> bool:
                if i == failing:
                    raise OSError(errno.EIO, "the disk went away")
                return i % 3 != 2 and block == key

            def done(results, error, calls=calls, answered=answered) -> None:
                calls.append((list(results), error, threading.current_thread()))
                answered.set()

            file_io.striped_async(pool, threads, fn, keys, list(keys), done)
            assert answered.wait(30)
            results, error, thread = calls[0]
            assert thread is not threading.current_thread()
            if failing is None:
                assert error is None and results == [i % 3 != 2 for i in range(10)]
            else:  # the failing key's stripe stops there; the other stripes finish
                assert isinstance(error, OSError)
                stride = min(threads, len(keys))
                for i in range(10):
                    lost = i % stride == failing % stride and i >= failing
                    assert results[i] == (not lost and i % 3 != 2), i
            assert len(calls) == 1

        def broken(results, error) -> None:
            raise RuntimeError("the caller's answer failed")

        file_io.striped_async(pool, 4, lambda i, k, b: True, keys, list(keys), broken)
        pool.shutdown(wait=True)  # every stripe has run
    assert "a transfer's completion failed" in caplog.text
    with pytest.raises(RuntimeError):
        file_io.striped_async(pool, 4, lambda i, k, b: True, keys, list(keys), calls.append)
    assert len(calls) == 1
