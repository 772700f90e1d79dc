"""Source files of released vLLM wheels, read without installing (or downloading) them.

A wheel is a zip file: its central directory sits at the end, and each member can be read on
its own. Over HTTP range requests only those parts travel (about 1 MiB of a 240 MB wheel).
What was read is kept in ``~/.cache/kvtier/vllm-releases/<version>/``, so later runs need no
network.
"""

from __future__ import annotations

import io
import json
import os
import urllib.request
import zipfile
from pathlib import Path

SIMPLE_INDEX = "https://pypi.org/simple/vllm/"
CHUNK_BYTES = 256 << 10
TIMEOUT_S = 60.0


def cache_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "kvtier" / "vllm-releases"


def released_source(version: str, member: str) -> str:
    """The text of ``member`` (a path inside the wheel) in vLLM ``version``'s x86-64 wheel."""
    cached = cache_dir() / version / member
    if cached.is_file():
        return cached.read_text()
    with zipfile.ZipFile(_RangeFile(_wheel_url(version))) as wheel:
        text = wheel.read(member).decode()
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.rename(cached)
    return text


def _wheel_url(version: str) -> str:
    request = urllib.request.Request(
        SIMPLE_INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
        files = json.load(answer)["files"]
    wanted = f"vllm-{version}-"
    for f in files:
        if f["filename"].startswith(wanted) and f["filename"].endswith("x86_64.whl"):
            return f["url"]
    raise LookupError(f"no x86-64 wheel of vllm {version} on {SIMPLE_INDEX}")


class _RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote file, fetched in chunks by HTTP range requests."""

    def __init__(self, url: str) -> None:
        self.url, self.pos = url, 0
        self.chunks: dict[int, bytes] = {}
        head = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(head, timeout=TIMEOUT_S) as answer:
            self.size = int(answer.headers["Content-Length"])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = base + offset
        return self.pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n = max(0, min(len(view), self.size - self.pos))
        done = 0
        while done < n:
            index, skip = divmod(self.pos + done, CHUNK_BYTES)
            chunk = self._chunk(index)[skip : skip + n - done]
            view[done : done + len(chunk)] = chunk
            done += len(chunk)
        self.pos += n
        return n

    def _chunk(self, index: int) -> bytes:
        if index not in self.chunks:
            start = index * CHUNK_BYTES
            end = min(start + CHUNK_BYTES, self.size) - 1
            request = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end}"})
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as answer:
                if answer.status != 206:
                    raise OSError(f"{self.url}: no range request support (HTTP {answer.status})")
                self.chunks[index] = answer.read()
        return self.chunks[index]
