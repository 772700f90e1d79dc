"""The timing harness of `kvtier bench storage`: trials run in turn (ours and the raw limit
see the same machine noise), rows of GB/s beside the raw limit, fresh keys per save."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from kvtier import KVCacheSpec
from kvtier.layout.checksum import payload_checksum
from kvtier.layout.keys import KeyScheme, block_hashes
from kvtier_bench.common import Timing, gbps


def _keys(spec: KVCacheSpec, n: int) -> list[str]:
    scheme = KeyScheme(f"bench-{uuid.uuid4().hex[:8]}", spec.fingerprint)
    tokens = torch.randint(0, 100_000, (n * spec.block_size,)).numpy()
    return scheme.keys(block_hashes(tokens, spec.block_size))


def _row(backend, op, spec, n, t: Timing, t_raw: Timing, runs) -> dict:
    nbytes = n * spec.block_bytes
    return {
        "backend": backend,
        "op": op,
        "object_bytes": spec.block_bytes,
        "object_mib": spec.block_bytes / 2**20,
        "num_objects": n,
        "gbps": gbps(nbytes, t.median),
        "gbps_range": t.gbps_range(nbytes),
        "raw_gbps": gbps(nbytes, t_raw.median),
        "ratio_to_raw": t_raw.median / t.median,
        "runs": runs,
    }


class Trial(NamedTuple):
    """One thing to time: ``op(fresh())`` with ``cleanup(inputs)`` after, untimed."""

    fresh: Callable[[], Any]
    op: Callable[[Any], None]
    cleanup: Callable[[Any], None] = lambda _: None


def _interleaved(trials: dict[str, Trial], runs: int) -> dict[str, Timing]:
    """Timing of each trial, running the trials in turn each round so that ours and the
    raw limit see the same machine noise. The first round warms up and is not counted."""
    times: dict[str, list[float]] = {name: [] for name in trials}
    for round_ in range(runs + 1):
        for name, trial in trials.items():
            inputs = trial.fresh()
            start = time.perf_counter()
            trial.op(inputs)
            elapsed = time.perf_counter() - start
            trial.cleanup(inputs)
            if round_:
                times[name].append(elapsed)
    return {name: Timing.of(t) for name, t in times.items()}


def _rows(backend, spec, n, timings: dict[str, Timing], raw: str, runs: int) -> list[dict]:
    return [
        _row(backend, op, spec, n, t, timings[raw], runs) for op, t in timings.items() if op != raw
    ]


def _save_trials(store, spec, blocks) -> dict[str, Trial]:
    """``save`` (the backend hashes) and ``save_prehashed`` (checksums known from the copy)."""
    n = len(blocks)
    known = [payload_checksum(b.numpy()) for b in blocks]

    def fresh():
        return _keys(spec, n)

    def save(keys, sums=None):
        assert all(store.put_from(keys, blocks, sums)), "bench storage: a save failed"

    return {
        "save": Trial(fresh, save, store.delete),
        "save_prehashed": Trial(fresh, lambda k: save(k, known), store.delete),
    }
