"""The kvtier command as a user runs it: real processes, real output."""

from __future__ import annotations

import json
import subprocess
import sys

REQUIRED_COPY_KEYS = {
    "block_size",
    "num_blocks",
    "direction",
    "gbps",
    "limit_gbps",
    "loop_gbps",
    "ratio_to_limit",
    "speedup_vs_loop",
}


def kvtier(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_demo_verifies_every_piece() -> None:
    out = kvtier("demo")
    assert out.returncode == 0, out.stderr
    assert "integrity: 2048 of 2048 (block, layer, part) pieces verified" in out.stdout
    data = json.loads(kvtier("demo", "--json", "--dtype", "block_wise_fp8").stdout)
    assert data["pieces_verified"] == data["pieces_total"] == 128 * 8 * 4


def test_bench_copy_json_rows() -> None:
    out = kvtier(
        "bench",
        "copy",
        "--json",
        "--block-sizes",
        "16",
        "--num-blocks",
        "4,32",
        "--layers",
        "2",
        "--runs",
        "1",
    )
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == 4
    for row in rows:
        assert row.keys() >= REQUIRED_COPY_KEYS
        assert row["gbps"] > 0 and row["limit_gbps"] > 0
    assert {r["direction"] for r in rows} == {"swap_out", "swap_in"}


def test_bench_copy_table() -> None:
    out = kvtier(
        "bench", "copy", "--block-sizes", "64", "--num-blocks", "8", "--layers", "1", "--runs", "1"
    )
    assert out.returncode == 0, out.stderr
    assert "x limit" in out.stdout and "swap_in" in out.stdout


def test_config_error_is_one_clear_line() -> None:
    out = kvtier("demo", "--dtype", "int3")
    assert out.returncode == 2
    assert out.stderr.strip().startswith("kvtier: error: dtype: got 'int3'; allowed:")
