"""Block ids: the one place that turns what a caller passed into ids and checks them.

Every task's ids pass here before any byte moves: a list that is not flat integers, an id out
of range, a destination named twice, or two lists of unequal length is an ``InvalidBlockIds``
naming the list and the first offending id.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.errors import InvalidBlockIds

SMALL = 16  # lists up to this long are checked in Python


def as_block_ids(ids: Any, what: str) -> np.ndarray:
    """Block ids as a 1-D int64 array; anything else is an InvalidBlockIds naming ``what``."""
    if hasattr(ids, "detach"):  # a torch tensor
        ids = ids.detach().cpu().numpy()
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as e:
        raise InvalidBlockIds(f"{what} must be a list of integers: {e}") from None
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidBlockIds(
            f"{what} must be a flat list of integers, got {arr.dtype} {arr.shape}"
        )
    return np.ascontiguousarray(arr, dtype=np.int64)  # native copies read it as a buffer


def check_block_ids(ids: np.ndarray, limit: int, what: str, *, destination: bool = False) -> None:
    """Every id of ``ids`` in ``0..limit-1``; a ``destination`` names no block twice.
    ``what`` names one id in messages ("device block id")."""
    if ids.size <= SMALL:  # a swap of a few blocks: Python is faster than numpy's calls
        small = ids.tolist()
        if small and (min(small) < 0 or max(small) >= limit):
            bad = next(i for i in small if not 0 <= i < limit)
            raise InvalidBlockIds(f"{what} {bad} out of range 0..{limit - 1}")
        if destination and len(set(small)) < len(small):
            raise InvalidBlockIds(f"{what} {first_duplicate(ids)} appears twice as a destination")
        return
    if not (ids.min() >= 0 and ids.max() < limit):
        bad = ids[(ids < 0) | (ids >= limit)]
        raise InvalidBlockIds(f"{what} {int(bad[0])} out of range 0..{limit - 1}")
    if destination:
        duplicate = first_duplicate(ids)
        if duplicate is not None:
            raise InvalidBlockIds(f"{what} {duplicate} appears twice as a destination")


def check_same_length(first: Any, second: Any, first_name: str, second_name: str) -> None:
    if len(first) != len(second):
        raise InvalidBlockIds(
            f"{first_name} has {len(first)} entries but {second_name} has {len(second)}"
        )


def first_duplicate(ids: np.ndarray) -> int | None:
    if ids.size < 2:
        return None
    ordered = np.sort(ids)
    same = ordered[1:] == ordered[:-1]
    return int(ordered[1:][same][0]) if same.any() else None
