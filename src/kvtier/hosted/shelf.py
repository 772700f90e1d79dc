"""Shelf: kvtier's storage inside an engine's own process, for that engine's offloading tiers.

SGLang's HiCache, LMCache's L2 adapters and vLLM's secondary tiers each hand their lower tier
host memory and a page hash. A Shelf turns those into kvtier objects: keys that carry the
model, the weight version, the layout fingerprint and the rank (``KeyScheme``), objects that
are checksummed (or MACed) and checked on every read, bounded tiers that evict. It runs no
kvtier worker process: the backends are opened here, and every call is thread-safe (the
backends' contract).

The engine's hash is used as it is when it is a plain 16–64-byte hash; anything else (a shorter
hash, or one that needs more context to be unique: LMCache's object group and cache salt) is
folded into a SHA-256 with that context first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kvtier.errors import ConfigError
from kvtier.hosted.settings import HostedSettings
from kvtier.layout.keys import (
    MAX_HASH_BYTES,
    MIN_HASH_BYTES,
    VERSION_FILE,
    KeyScheme,
    read_weight_version,
)
from kvtier.layout.spec import CacheDType, KVCacheSpec
from kvtier.storage import StorageBackend, make_backend
from kvtier.storage.base import Done, StartsTransfers

log = logging.getLogger(__name__)

# How often a Shelf reading its version from ``model_dir`` looks at the file again (one stat):
# a weight update is seen within this, and a lookup costs no file access in between.
VERSION_CHECK_S = 1.0
_FOLD_DOMAIN = b"kvtier-hosted-v1\0"
# Key schemes kept built (one per rank in use): an engine has a few ranks; LMCache names one
# per key in its own benchmark.
MAX_SCHEMES = 1024
# A batch of scattered objects this large is written by this many threads at once (a store
# writes them one by one; its whole-block puts use as many threads: storage/file/store.py).
WRITE_STRIPES = 4
STRIPE_MIN_BYTES = 1 << 20


def fold_hash(engine_hash: bytes, context: bytes = b"") -> bytes:
    """The kvtier block hash for ``engine_hash`` under ``context``: the hash itself when it is a
    plain 16–64-byte hash and there is no context, else a SHA-256 of both (never ambiguous:
    each part is length-prefixed)."""
    if not context and MIN_HASH_BYTES <= len(engine_hash) <= MAX_HASH_BYTES:
        return engine_hash
    h = hashlib.sha256(_FOLD_DOMAIN)
    h.update(struct.pack("<I", len(engine_hash)))
    h.update(engine_hash)
    h.update(context)
    return h.digest()


def bytes_spec(object_bytes: int, layout: str) -> KVCacheSpec:
    """A layout for engines that hand over opaque objects of ``object_bytes`` bytes; ``layout``
    names their byte order (in the fingerprint: another order or size is another key)."""
    if object_bytes <= 0:
        raise ConfigError("object_bytes", f"must be > 0, got {object_bytes}")
    return KVCacheSpec(
        num_layers=1,
        num_blocks=1,
        num_kv_heads=1,
        block_size=1,
        head_dim=object_bytes,
        dtype=CacheDType.UINT8,
        has_value=False,
        engine_layout=layout,
    )


class _Version:
    """The weight version: fixed, or read from ``model_dir`` and read again when it changes."""

    def __init__(self, settings: HostedSettings) -> None:
        self._fixed = settings.weight_version
        self._file = Path(settings.model_dir) / VERSION_FILE if settings.model_dir else None
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        self._value = self._fixed or ""
        self._lock = threading.Lock()
        if self._file is not None:
            self._refresh()

    def current(self) -> str:
        if self._file is not None and time.monotonic() - self._checked >= VERSION_CHECK_S:
            with self._lock:
                self._refresh()
        return self._value

    def _refresh(self) -> None:
        assert self._file is not None
        self._checked = time.monotonic()
        try:
            st = os.stat(self._file)
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = None
        if stamp == self._stamp and self._stamp is not None:
            return
        self._stamp = stamp
        value = read_weight_version(self._file.parent)
        if value != self._value:
            log.info("kvtier: weight version %r -> %r (%s)", self._value, value, self._file)
        self._value = value


class Shelf:
    """One engine rank's objects of one layout in kvtier's storage (module docstring).

    ``open()`` opens the backend (the file store scans its directory); ``close()`` closes it.
    """

    def __init__(self, settings: HostedSettings, spec: KVCacheSpec, rank: int = 0) -> None:
        if not settings.namespace:
            raise ConfigError("namespace", "must not be empty (the engine's model name)")
        self.settings = settings
        self.spec = spec
        self.rank = rank
        self.object_bytes = spec.block_bytes
        self._version = _Version(settings)
        self._schemes: dict[tuple[str, int], KeyScheme] = {}
        self._schemes_version = ""
        self._backend: StorageBackend | None = None
        self._writers: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # ---- lifecycle ---------------------------------------------------------------------------

    def open(self) -> Shelf:
        if self._backend is None:
            self._backend = make_backend(self.spec, self.settings.storage)
        return self

    def close(self) -> None:
        with self._pool_lock:
            writers, self._writers = self._writers, None
        if writers is not None:
            writers.shutdown(wait=True)
        backend, self._backend = self._backend, None
        if backend is not None:
            backend.close()

    def __enter__(self) -> Shelf:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def backend(self) -> StorageBackend:
        if self._backend is None:
            raise RuntimeError("Shelf.open() first")
        return self._backend

    # ---- keys --------------------------------------------------------------------------------

    @property
    def version(self) -> str:
        return self._version.current()

    def keys(
        self, block_hashes: Sequence[bytes], rank: int | None = None, version: str | None = None
    ) -> list[str]:
        """Storage keys of ``block_hashes`` (kvtier hashes: ``fold_hash``) for ``rank`` (default:
        this shelf's) under ``version`` (default: the current weight version): build them once
        per task, so a version change mid-task cannot split it."""
        rank = self.rank if rank is None else rank
        version = self.version if version is None else version
        scheme = self._schemes.get((version, rank))
        if scheme is None:
            if len(self._schemes) >= MAX_SCHEMES or version != self._schemes_version:
                self._schemes = {}  # an old version's keys are never built again
                self._schemes_version = version
            scheme = KeyScheme(self.settings.namespace, self.spec.fingerprint, rank, version)
            self._schemes[(version, rank)] = scheme
        return scheme.keys(block_hashes)

    # ---- data --------------------------------------------------------------------------------

    def lookup_prefix(self, keys: Sequence[str]) -> int:
        return self.backend.exists_prefix(keys)

    def lookup_each(self, keys: Sequence[str]) -> list[bool]:
        backend = self.backend
        return [backend.holds(key) for key in keys]

    def put(self, keys: Sequence[str], blocks: Sequence[torch.Tensor]) -> list[bool]:
        """Store each block (a uint8 tensor of ``object_bytes``) under its key."""
        return self.backend.put_from(keys, blocks)

    def get(self, keys: Sequence[str], blocks: Sequence[torch.Tensor]) -> list[bool]:
        """Fill each block with its key's object; True only where the bytes are exactly the
        stored ones (checksum or MAC, layout fingerprint, key)."""
        return self.backend.get_into(keys, blocks)

    @property
    def starts_transfers(self) -> bool:
        """Whether the store runs reads and writes on threads of its own (``start_get``,
        ``start_put``: ``StartsTransfers``)."""
        return self.backend.starts_transfers() is not None

    def start_get(self, keys: Sequence[str], buffers: Sequence[memoryview], done: Done) -> None:
        """``get`` into byte buffers on the store's own threads (``starts_transfers``):
        returns at once, and ``done(found, None)`` or ``done(None, error)`` is called once when
        every key is read. Raises, without calling ``done``, when the read cannot start."""
        self._starts().start_read(keys, buffers, done)

    def start_put(self, keys: Sequence[str], buffers: Sequence[memoryview], done: Done) -> None:
        """``put`` from byte buffers on the store's own threads, answered as ``start_get``
        is (``done(stored, None)``)."""
        self._starts().start_write(keys, buffers, done)

    def _starts(self) -> StartsTransfers:
        starts = self.backend.starts_transfers()
        if starts is None:
            raise RuntimeError(f"a {self.backend.kind} store moves bytes only in get() and put()")
        return starts

    def put_pieces(self, keys: Sequence[str], pieces: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Store each key's object from its pieces, in order (an engine page that lies in
        several buffers: SGLang's K and V). Straight from them where the store writes pieces
        (``ScatteredIO``), else gathered into one block first."""
        scattered = self.backend.scattered()
        if scattered is None or not scattered.covers_all:
            blocks = [_gather(parts, self.object_bytes) for parts in pieces]
            return self.backend.put_from(keys, blocks)
        stripes = min(WRITE_STRIPES, len(keys) * self.object_bytes // STRIPE_MIN_BYTES)
        if stripes < 2:
            return scattered.put_from_scattered(keys, pieces)
        # A store writes scattered objects one at a time (its put_from stripes whole blocks
        # over its own threads): a large batch is split over this shelf's writers instead.
        pool = self._writer_pool()
        parts = [pool.submit(scattered.put_from_scattered, keys[i::stripes], pieces[i::stripes])
                 for i in range(stripes)]  # fmt: skip
        results = [f.result() for f in parts]
        out = [False] * len(keys)
        for i, stored in enumerate(results):
            out[i::stripes] = stored
        return out

    def _writer_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._writers is None:
                self._writers = ThreadPoolExecutor(WRITE_STRIPES, thread_name_prefix="kvtier-put")
            return self._writers

    def get_pieces(self, keys: Sequence[str], pieces: Sequence[Sequence[memoryview]]) -> list[bool]:
        """Fill each key's pieces with its object, checked as ``get`` is; stops at the first
        miss (the caller uses the leading run). Pieces of a miss are left or zeroed, never hold
        bytes that failed a check."""
        scattered = self.backend.scattered()
        if scattered is not None and scattered.covers_all:
            return scattered.get_into_scattered(keys, pieces)
        blocks = [torch.empty(self.object_bytes, dtype=torch.uint8) for _ in keys]
        found = self.backend.get_into(keys, blocks)
        for block, parts, hit in zip(blocks, pieces, found, strict=True):
            if hit:
                _scatter(block, parts)
        return found

    def delete(self, keys: Sequence[str]) -> int:
        return self.backend.delete(keys)

    def stats(self) -> dict[str, Any]:
        backend = self.backend
        usage = backend.usage()
        return {
            **backend.stats.as_dict(),
            "used_bytes": usage.used_bytes,
            "objects": usage.num_objects,
            "capacity_bytes": usage.capacity_bytes,
            "weight_version": self.version,
        }


def as_block(buffer: memoryview | torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over ``buffer`` without a copy."""
    if isinstance(buffer, torch.Tensor):
        return buffer.view(torch.uint8).reshape(-1) if buffer.is_contiguous() else buffer
    return torch.frombuffer(buffer, dtype=torch.uint8)


def _gather(parts: Sequence[memoryview], total: int) -> torch.Tensor:
    block = torch.empty(total, dtype=torch.uint8)
    flat = block.numpy().data
    at = 0
    for part in parts:
        flat[at : at + part.nbytes] = part.cast("B")
        at += part.nbytes
    if at != total:
        raise ValueError(f"pieces of {at} bytes for an object of {total}")
    return block


def _scatter(block: torch.Tensor, parts: Sequence[memoryview]) -> None:
    flat = block.numpy().data
    at = 0
    for part in parts:
        part.cast("B")[:] = flat[at : at + part.nbytes]
        at += part.nbytes
