"""Scattered copies: objects moved between one contiguous buffer each and the pieces they
spread over (a stored object's payload and its device block's (layer, part) pieces), hashed
on the way.

``copy_scattered`` is one native call for a whole batch (``kvtier._copy``): each piece copied,
then its source hashed while it is still in cache, so the XXH3-64 of every object costs no
second pass over memory; large batches are split over threads without the GIL. Without the
native module it does the same in Python (a slice assignment per piece, then the hash).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import xxhash

from kvtier.memory import stores

_copy: Any = None
try:
    from kvtier import _copy  # type: ignore[no-redef]
except ImportError:  # built without a C compiler
    pass

# Below this many bytes a second copy thread costs more than it saves (as ``kvtier.memory.copier``).
PARALLEL_MIN_BYTES = 4 << 20

Buffer = Any  # a memoryview, numpy array or bytearray (writable where written)


def copy_scattered(
    contiguous: Sequence[Buffer],
    pieces: Sequence[Sequence[Buffer]],
    *,
    to_pieces: bool,
    hashes: np.ndarray | None = None,
) -> int:
    """Copy object ``i`` from ``contiguous[i]`` into the buffers of ``pieces[i]`` in order
    (``to_pieces``), or from them into ``contiguous[i]``; with ``hashes`` (uint64, one per
    object), ``hashes[i]`` is the XXH3-64 of object i's bytes. Each object's pieces must add up
    to its contiguous buffer (ValueError otherwise). Returns the bytes copied."""
    whole = contiguous if isinstance(contiguous, list) else list(contiguous)
    parts = [row if isinstance(row, (list, tuple)) else list(row) for row in pieces]
    if len(whole) != len(parts):
        raise ValueError("one list of pieces per contiguous buffer")
    if _copy is not None:
        total = sum(memoryview(b).nbytes for b in whole)
        threads = torch.get_num_threads() if total >= PARALLEL_MIN_BYTES and len(whole) > 1 else 1
        return int(
            stores.choice(_copy).run(
                total, lambda: _copy.copy_scattered(whole, parts, to_pieces, hashes, threads)
            )
        )
    return _copy_in_python(whole, parts, to_pieces, hashes)


def _copy_in_python(
    whole: list[Buffer],
    parts: Sequence[Sequence[Buffer]],
    to_pieces: bool,
    hashes: np.ndarray | None,
) -> int:
    total = 0
    for i, (buffer, row) in enumerate(zip(whole, parts)):
        flat = memoryview(buffer).cast("B")
        sizes = [memoryview(p).nbytes for p in row]
        if sum(sizes) != flat.nbytes:
            raise ValueError(f"object {i}: its pieces do not add up to its {flat.nbytes} bytes")
        state = xxhash.xxh3_64() if hashes is not None else None
        offset = 0
        for piece, n in zip(row, sizes):
            view = memoryview(piece).cast("B")
            if to_pieces:
                view[:] = flat[offset : offset + n]
            else:
                flat[offset : offset + n] = view
            if state is not None:
                state.update(view)
            offset += n
        if state is not None and hashes is not None:
            hashes[i] = state.intdigest()
        total += offset
    return total
