"""``kvtier bench hosted --only surfaces`` runs every surface against the store alone and its
started transfers, and prints one row per surface and operation with its ratios (a smoke run:
one round of small batches; the figures themselves are the benchmark's, not a test's)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import require_peer, require_vllm

require_peer("lmcache")
require_peer("sglang")
require_vllm()


def test_the_surfaces_bench_prints_every_row_with_its_ratios(tmp_path) -> None:
    cmd = [
        sys.executable, "-m", "kvtier.ops.cli", "bench", "hosted", "--only", "surfaces",
        "--surface-rounds", "1", "--num-keys", "4", "--data-size-kb", "64",
        "--root", str(tmp_path), "--json",
    ]  # fmt: skip
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert {(r["surface"], r["op"]) for r in rows} == {
        (surface, op) for surface in ("lmcache", "sglang", "vllm tier") for op in ("store", "load")
    }
    for row in rows:
        assert row["surface_ms"] > 0 and row["alone_ms"] > 0 and row["started_ms"] > 0
        assert row["ratio"] > 0 and row["ratio_started"] > 0
    assert not list(tmp_path.iterdir())  # each surface's folder is removed
