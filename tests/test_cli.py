"""The kvtier command as a user runs it: real processes, real output."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from conftest import require_mooncake

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


def test_demo_verifies_every_block_and_leaves_nothing_behind() -> None:
    from kvtier.config import default_socket_dir

    shm_before = set(Path("/dev/shm").glob("kvtier-demo*"))
    tmp_before = set(Path(tempfile.gettempdir()).glob("kvtier-demo*"))
    out = kvtier("demo")
    assert out.returncode == 0, out.stderr
    assert "integrity:" in out.stdout and "prefill avoided" in out.stdout
    line = next(x for x in out.stdout.splitlines() if "integrity:" in x)
    verified, total = (int(x) for x in re.findall(r"\d+", line)[:2])
    assert verified == total > 1000
    assert "turn 6/6" in out.stderr  # progress while it runs
    # Nothing new (the start may also have reclaimed what earlier, killed runs left).
    assert set(Path("/dev/shm").glob("kvtier-demo*")) <= shm_before
    assert set(Path(tempfile.gettempdir()).glob("kvtier-demo*")) <= tmp_before
    assert not list(default_socket_dir().glob("demo*"))
    data = json.loads(
        kvtier(
            "demo",
            "--json",
            "--users",
            "4",
            "--turns",
            "3",
            "--backend",
            "memory",
            "--write-policy",
            "write_back",
        ).stdout
    )
    assert data["blocks_verified"] == data["blocks_checked"] > 0
    assert data["requests"] == 12 and 0 < data["prefill_avoided"] < 1


def test_demo_on_mooncake_with_a_local_master_and_store_node() -> None:
    require_mooncake()
    out = kvtier(
        "demo",
        "--json",
        "--backend",
        "mooncake",
        "--users",
        "3",
        "--turns",
        "2",
        "--device-blocks",
        "48",
        "--host-blocks",
        "0",
    )
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout)
    assert data["backend"] == "mooncake"
    assert data["blocks_verified"] == data["blocks_checked"] > 0
    assert data["tokens"]["storage"] > 0  # blocks really came back from the store node


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_e2e_shows_each_tier_helps(tmp_path) -> None:
    out = kvtier(
        "bench",
        "e2e",
        "--json",
        "--runs",
        "1",
        "--plot",
        str(tmp_path / "e2e.png"),
        "--users",
        "6",
        "--turns",
        "4",
        "--device-blocks",
        "64",
        "--host-blocks",
        "48",
    )
    assert out.returncode == 0, out.stderr
    device_only, with_host, full = (json.loads(x) for x in out.stdout.splitlines())
    assert device_only["host"] == device_only["storage"] == 0
    assert full["prefill_avoided"] > with_host["prefill_avoided"] >= device_only["prefill_avoided"]
    assert (tmp_path / "e2e.png").read_bytes().startswith(PNG_MAGIC)


def test_bench_e2e_says_when_the_device_cache_holds_everything() -> None:
    out = kvtier("bench", "e2e", "--users", "1", "--turns", "1", "--runs", "1")
    assert out.returncode == 0, out.stderr
    assert "kvtier bench e2e (1 user x 1 turn, 2 ranks" in out.stdout
    assert "holds the whole working set (40 blocks)" in out.stdout


def test_bench_storage_with_and_without_a_mac_and_its_plot(tmp_path) -> None:
    out = kvtier(
        "bench", "storage", "--backends", "file", "--sizes", "1", "--bytes-per-run", str(8 << 20),
        "--runs", "1", "--mac", "both", "--json", "--plot", str(tmp_path / "storage.png"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert {(r["op"], r["mac"]) for r in rows} >= {("save", "off"), ("save", "on")}
    assert all(r["gbps"] > 0 and "-" in r["gbps_range"] for r in rows)
    assert (tmp_path / "storage.png").read_bytes().startswith(PNG_MAGIC)


def test_bench_copy_json_rows(tmp_path) -> None:
    out = kvtier(
        "bench",
        "copy",
        "--json",
        "--plot",
        str(tmp_path / "copy.png"),
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
    assert (tmp_path / "copy.png").read_bytes().startswith(PNG_MAGIC)


def test_bench_copy_table() -> None:
    out = kvtier(
        "bench", "copy", "--block-sizes", "64", "--num-blocks", "8", "--layers", "1", "--runs", "1"
    )
    assert out.returncode == 0, out.stderr
    assert "x limit" in out.stdout and "swap_in" in out.stdout


def test_config_error_is_one_clear_line() -> None:
    out = kvtier("bench", "copy", "--block-sizes", "0", "--num-blocks", "4")
    assert out.returncode == 2
    assert out.stderr.strip().startswith("kvtier: error: block_size: must be a positive integer")


def _one_line_error(out: subprocess.CompletedProcess, *needles: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = out.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("kvtier: error: ")]
    # One error line, the last thing printed (progress lines may come before it), no traceback.
    assert len(errors) == 1 and lines[-1] == errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_every_cli_error_is_one_line_that_names_the_field(tmp_path) -> None:
    shm_before = set(Path("/dev/shm").iterdir())
    _one_line_error(kvtier("demo", "--ranks", "0"), "ranks: must be an integer in 1..64")
    _one_line_error(kvtier("demo", "--users", "10000000000"), "users: must be an integer")
    # Larger than /dev/shm: refused before anything is mapped (it used to die of SIGBUS).
    _one_line_error(
        kvtier("demo", "--device-blocks", "4000000"), "needs", "GiB of shared memory", "free"
    )
    # Larger than the memory available: refused by the worker before it allocates.
    _one_line_error(
        kvtier("demo", "--host-blocks", "4000000", "--ranks", "1"),
        "rank 0 did not start",
        "num_host_blocks: needs",
    )
    assert set(Path("/dev/shm").iterdir()) <= shm_before


def test_serve_settings_from_the_environment_and_flags_that_do_nothing(tmp_path) -> None:
    import socket

    import yaml

    from worker_helpers import WSPEC

    def serve(*flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
        import os

        return subprocess.run(
            [sys.executable, "-m", "kvtier.cli", "serve", *flags],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, **(env or {})},
        )

    spec_yaml = yaml.safe_dump(WSPEC.to_dict(), default_flow_style=True).strip()
    base = ["--instance-id", "envtest", "--device-cache-mode", "create"]
    _one_line_error(
        serve(*base, env={"KVTIER_SPEC": spec_yaml, "KVTIER_LOG_LEVEL": "LOUD"}),
        "log_level: got 'LOUD'; allowed: DEBUG, INFO, WARNING, ERROR",
    )
    _one_line_error(
        serve(*base, env={"KVTIER_SPEC": "[1, 2]"}), "spec: KVTIER_SPEC must be a YAML or JSON"
    )
    _one_line_error(
        serve(*base, env={"KVTIER_SPEC": spec_yaml, "KVTIER_STORAGE": "{backend: redis}"}),
        "storage.backend: got 'redis'",
    )
    legacy = ["--key_cache_shape", "10,2,16,64", "--num_layers", "2", *base]
    _one_line_error(serve(*legacy, "--write_policy", "write_back"), "write_policy: write_back is")
    _one_line_error(serve(*legacy, "--device_id", "0"), "device_id: applies to --device cuda")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        out = serve(
            *base,
            "--metrics-port",
            port,
            "--engine-timeout-s",
            "1",
            env={
                "KVTIER_SPEC": spec_yaml,
                "KVTIER_STORAGE": "{backend: memory}",
                "KVTIER_COLOUR": "red",
            },
        )
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"metrics_port: cannot serve metrics on 127.0.0.1:{port}" in out.stderr
    assert "KVTIER_COLOUR is not a kvtier setting" in out.stderr  # reported, not fatal
