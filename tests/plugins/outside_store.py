"""A storage backend that lives outside the kvtier package, written against its public storage
API only (``kvtier.storage``: the interface, the helper base ``ObjectStore`` and the object
format), and named in configuration alone::

    {"backend": "outside", "module": "outside_store"}

Objects are files in one flat directory (``root``), written whole and renamed into place: the
smallest real backend, persistent and shared between processes. The contract suite runs on it
(tests/cluster/test_storage_s3.py) to prove a third party needs no code registration.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.errors import ConfigError, ObjectCorrupt
from kvtier.storage import HEADER_BYTES, ObjectStore, Read, ReadResult, StorageUsage


@dataclass(frozen=True)
class OutsideConfig:
    root: Path


def parse_options(data: Mapping[str, Any]) -> OutsideConfig:
    unknown = set(data) - {"backend", "root"}
    if unknown:
        raise ConfigError(f"storage.{sorted(unknown)[0]}", "unknown option for the outside backend")
    if not isinstance(data.get("root"), str):
        raise ConfigError("storage.root", "names the directory of the outside backend")
    return OutsideConfig(Path(data["root"]))


def open_backend(spec, options: OutsideConfig, mac_key: bytes | None) -> ObjectStore:
    return OutsideStore(spec, options.root, mac_key)


class OutsideStore(ObjectStore):
    kind = "outside"
    exposes_registered_memory = False
    persistent = True

    def __init__(self, spec, root: Path, mac_key: bytes | None = None) -> None:
        super().__init__(spec, mac_key)
        self.root = root
        root.mkdir(mode=0o700, parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        return self.root / hashlib.sha256(key.encode()).hexdigest()

    def exists_prefix(self, keys) -> int:
        for n, key in enumerate(keys):
            if not self._path(key).is_file():
                return n
        return len(keys)

    def _read(self, request: Read, result: ReadResult) -> None:
        for i, (key, block) in enumerate(zip(request.keys, request.host_blocks)):
            data = self.read_object(key)
            if data is None:
                continue  # a miss: ``result.found[i]`` stays False
            try:
                if len(data) != self.object_bytes:
                    raise ObjectCorrupt(f"object is {len(data)} bytes")
                view = memoryview(data)
                self.format.check_or_defer(
                    view[:HEADER_BYTES],
                    view[HEADER_BYTES:],
                    key,
                    result.checksums,  # None: checked here; else the caller checks the payload
                    i,
                    headers_out=result.headers,
                )
            except ObjectCorrupt as e:
                self._corrupt(key, e)
                self.delete([key])
                continue
            block.numpy()[:] = np.frombuffer(data, dtype=np.uint8, offset=HEADER_BYTES)
            result.found[i] = True

    def put_from(self, keys, host_blocks, checksums=None, originals=None) -> list[bool]:
        self._check_batch(keys, host_blocks, checksums)
        if originals is not None:
            self._check_scattered(keys, originals)
        for i, (key, block) in enumerate(zip(keys, host_blocks)):
            if self._path(key).is_file():
                continue
            if originals is not None:
                payload = b"".join(bytes(v) for v in originals[i])
                known = None
            else:
                payload = block.numpy().tobytes()
                known = checksums[i] if checksums is not None else None
            self.write_object(key, self.format.header(key, [payload], known) + payload)
        return self._count_puts([True] * len(keys))

    def delete(self, keys) -> int:
        removed = 0
        for key in keys:
            try:
                self._path(key).unlink()
                removed += 1
            except FileNotFoundError:
                pass
        return removed

    def usage(self) -> StorageUsage:
        files = [p for p in self.root.iterdir() if not p.name.endswith(".tmp")]
        return StorageUsage(sum(p.stat().st_size for p in files), len(files), None)

    def read_object(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def write_object(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = path.parent / f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_bytes(data)
        tmp.replace(self._path(key))
