"""The kvtier command as a user runs it: real processes, real output."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import paths_below, require_mooncake

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


def kvtier(
    *args: str, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.ops.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _private_dirs(tmp_path: Path) -> dict[str, str]:
    """TMPDIR and XDG_RUNTIME_DIR of the test's own: what a run leaves there is the run's."""
    return {"TMPDIR": str(tmp_path), "XDG_RUNTIME_DIR": str(tmp_path)}


def _left_by(instance: str, tmp_path: Path) -> list[str]:
    """What a run named ``instance`` left: its /dev/shm names, any file or launch/demo directory
    in the test's private directories. Other programs' files are not looked at."""
    shm = [p.name for p in Path("/dev/shm").iterdir() if instance in p.name]
    files = [
        str(p.relative_to(tmp_path))
        for p in paths_below(tmp_path)
        if not p.is_dir() or p.name.startswith(("kvtier-launch-", "kvtier-demo-"))
    ]
    return shm + files


def test_demo_verifies_every_block_and_leaves_nothing_behind(short_tmp_path) -> None:
    instance = f"demo{uuid.uuid4().hex[:8]}"
    tmp_path = short_tmp_path  # the workers' sockets live below it: a Unix socket path is short
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    out = kvtier("demo", "--instance-id", instance, env=_private_dirs(run_dir))
    assert out.returncode == 0, out.stderr
    assert "integrity:" in out.stdout and "prefill avoided" in out.stdout
    line = next(x for x in out.stdout.splitlines() if "integrity:" in x)
    verified, total = (int(x) for x in re.findall(r"\d+", line)[:2])
    assert verified == total > 1000
    assert "turn 6/6" in out.stderr  # progress while it runs
    assert _left_by(instance, run_dir) == []
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
    instance = f"demo{uuid.uuid4().hex[:8]}"
    env = _private_dirs(tmp_path)

    def demo(*flags: str) -> subprocess.CompletedProcess:
        return kvtier("demo", "--instance-id", instance, *flags, env=env)

    _one_line_error(demo("--ranks", "0"), "ranks: must be an integer >= 1")
    _one_line_error(demo("--ranks", "65"), "ranks: must be an integer in 1..64")
    _one_line_error(demo("--users", "10000000000"), "users: must be an integer")
    # A prompt longer than the device cache: refused at once (it failed at turn 17 of 50).
    _one_line_error(demo("--turns", "50"), "turns: the last turn's prompt is 432 blocks", "16")
    # Larger than /dev/shm: refused before anything is mapped (it used to die of SIGBUS).
    _one_line_error(demo("--device-blocks", "4000000"), "needs", "GiB of shared memory", "free")
    # Larger than the memory available: refused by the worker before it allocates.
    _one_line_error(
        demo("--host-blocks", "4000000", "--ranks", "1"),
        "rank 0 did not start",
        "num_host_blocks: needs",
    )
    assert _left_by(instance, tmp_path) == []


def test_serve_settings_from_the_environment_and_flags_that_do_nothing(tmp_path) -> None:
    import socket

    import yaml

    from worker_helpers import WSPEC

    def serve(*flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
        import os

        return subprocess.run(
            [sys.executable, "-m", "kvtier.ops.cli", "serve", *flags],
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


# ---- what a newcomer hit ------------------------------------------------------------------------


def _blocking(tmp_path: Path, *modules: str) -> dict[str, str]:
    """An environment in which ``modules`` are not installed (a sitecustomize refuses them)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"BLOCKED = {modules!r}\n"
        "class Blocker:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if any(name == m or name.startswith(m + '.') for m in BLOCKED):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, Blocker())\n"
    )
    return {"PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["demo", "--seed", "-1"], "--seed: must be an integer in 0..4294967295, got '-1'"),
        (["demo", "--json", "--seed", "-1"], "--seed: must be an integer in 0..4294967295"),
        (["demo", "--turns", "two"], "--turns: must be an integer >= 1, got 'two'"),
        (["bench", "e2e", "--seed", "-1"], "--seed: must be an integer in 0..4294967295"),
        (["bench", "copy", "--runs", "0"], "--runs: must be an integer >= 1, got '0'"),
        (["bench", "storage", "--bytes-per-run", "-5"], "--bytes-per-run: '-5': a size cannot"),
        (["bench", "latency", "--n", "-3"], "--n: must be an integer >= 1, got '-3'"),
        (["status", "x", "--timeout", "0"], "--timeout: must be a number > 0, got '0'"),
        (["store", "gc", "/nonexistent", "--capacity", "-5G"], "--capacity: '-5G': a size cannot"),
        (["store", "gc", "/nonexistent", "--older-than", "soon"], "--older-than: 'soon' is not"),
        (["serve", "--rank", "-1"], "--rank: must be an integer >= 0, got '-1'"),
    ],
)
def test_every_numeric_option_is_checked_in_one_line(argv, needle) -> None:
    """`kvtier demo --seed -1` printed a 33-line numpy traceback; `--capacity -5G` got its
    real error only as `--capacity=-5G`."""
    _one_line_error(kvtier(*argv), needle)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["bench", "copy", "--device", "cuda"], "--device: cuda asked for, but this torch"),
        (["status", "--endpoint", "garbage"], "--endpoint: 'garbage' is not a worker endpoint"),
        (["status", "--endpoint", "tcp://127.0.0.1"], "is not a worker endpoint"),
        (["bench", "e2e", "--plot", "/nonexistent/x.png"], "--plot: /nonexistent does not exist"),
        (["bench", "storage", "--backends", "file,nope"], "--backends: 'nope' given: choose"),
        (["bench", "storage", "--sizes", "3"], "--sizes: '3' given: choose from 1, 8"),
        (["demo", "--engine", "vllm", "--backend", "mooncake", "--ranks", "3"], "--ranks, --back"),
        (["demo", "--device-blocks", "1"], "use --device-blocks 80 or more"),
    ],
)
def test_round_five_bad_inputs_are_one_line_and_nothing_is_ignored(argv, needle) -> None:
    """Each printed a traceback (CUDA on a CPU torch, a garbage endpoint), failed only after the
    whole benchmark ran (a plot in a missing folder), lacked the error prefix (a backend), ran
    ignoring the options (``demo --engine vllm --backend mooncake --ranks 3``: 45 s), or advised
    a negative count ("use --turns -4 or fewer")."""
    if argv[:3] == ["bench", "copy", "--device"]:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this torch has CUDA: the refusal is for a CPU-only build")
    out = kvtier(*argv)
    _one_line_error(out, needle)
    assert "-4 or fewer" not in out.stderr


def test_serve_refuses_a_cuda_device_this_torch_has_not(tmp_path) -> None:
    import torch
    import yaml

    from worker_helpers import WSPEC

    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA: the refusal is for a CPU-only build")
    spec = yaml.safe_dump(WSPEC.to_dict(), default_flow_style=True).strip()
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.ops.cli", "serve", "--device", "cuda", "--instance-id", "x"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KVTIER_SPEC": spec, "KVTIER_STORAGE": "{backend: memory}"},
    )
    _one_line_error(out, "device: cuda asked for, but this torch")


def test_every_option_of_every_command_says_what_it_does() -> None:
    """``kvtier serve --help`` had 9 options without a word."""
    import argparse

    from kvtier.ops.cli import _bench_parser, build_parser
    from kvtier_bench.options import ARGUMENTS

    silent = []

    def walk(parser: argparse.ArgumentParser, path: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, [*path, name])
            elif action.help is None:
                silent.append(" ".join([*path, *action.option_strings[:1]]))

    walk(build_parser(), ["kvtier"])
    for name in ARGUMENTS:  # the benchmarks' own parsers (their options follow `kvtier bench`)
        walk(_bench_parser(name), ["kvtier", "bench", name])
    assert silent == []


def test_sizes_parse_one_way_everywhere(tmp_path) -> None:
    from kvtier.ops.cli import _bench_parser, build_parser

    bench = _bench_parser("storage").parse_args(["--bytes-per-run", "64M"])
    assert bench.bytes_per_run == 64 << 20  # it was refused: "invalid int value: '64M'"
    gc = build_parser().parse_args(["store", "gc", str(tmp_path), "--capacity", "500M"])
    assert gc.capacity == 500 << 20
    assert _bench_parser("storage").parse_args(["--bytes-per-run", "4096"]).bytes_per_run == 4096


def test_a_mistyped_flag_shows_the_subcommands_usage() -> None:
    out = kvtier("demo", "--sed", "1")
    assert out.returncode == 2 and "usage: kvtier demo" in out.stderr, out.stderr
    assert out.stderr.strip().endswith("kvtier: error: unrecognized arguments: --sed 1")
    out = kvtier("store", "gc", "/nonexistent", "--capacitty", "1G")
    assert out.returncode == 2 and "usage: kvtier store gc" in out.stderr, out.stderr


def test_bench_help_answers_without_torch_and_says_what_the_mac_is() -> None:
    from kvtier.ops.cli import BENCHES

    code = (
        "import sys, contextlib, io\n"
        "from kvtier.ops.cli import main\n"
        "for name in sys.argv[1:]:\n"
        "    out = io.StringIO()\n"
        "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
        "        main(['bench', name, '--help'])\n"
        "    print('=====', name, 'torch' in sys.modules)\n"
        "    print(out.getvalue())\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, *BENCHES], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    for name in BENCHES:
        assert f"===== {name} False" in out.stdout  # torch is not imported for --help
    storage_help = out.stdout.split("===== storage")[1].split("=====")[0]
    assert "BLAKE3" in storage_help and "HMAC" not in storage_help
    assert "review" not in storage_help  # it cited a review that is not in the repository


def test_plot_without_matplotlib_fails_before_the_benchmark_runs(tmp_path) -> None:
    out = kvtier(
        "bench", "copy", "--plot", str(tmp_path / "x.png"), env=_blocking(tmp_path, "matplotlib")
    )
    _one_line_error(out, "--plot: needs matplotlib", "pip install 'kvtier[plot]'")
    assert "device" not in out.stdout  # no benchmark row was printed


def test_keep_store_takes_only_a_new_empty_or_kvtier_directory(tmp_path) -> None:
    """`kvtier demo --keep-store /etc` wrote objects/ and tmp/ into /etc. The run that is
    allowed also has no native copier: the demo says so (the workers' log said it alone)."""
    from kvtier.ops.demo_run import check_keep_store

    other = tmp_path / "other"
    other.mkdir()
    (other / "passwd").write_text("root:x:0:0\n")
    _one_line_error(
        kvtier("demo", "--keep-store", str(other)),
        "keep_store:",
        "is not empty and not a kvtier file store (it holds passwd)",
    )
    assert sorted(p.name for p in other.iterdir()) == ["passwd"]
    (tmp_path / "a-file").write_text("x")
    _one_line_error(kvtier("demo", "--keep-store", str(tmp_path / "a-file")), "not a directory")
    store = tmp_path / "store"
    env = {**_private_dirs(tmp_path), **_blocking(tmp_path, "kvtier._copy")}
    out = kvtier(
        "demo", "--keep-store", str(store), "--users", "2", "--turns", "2", "--ranks", "1", env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "kvtier demo: note: kvtier._copy is not built" in out.stderr
    assert (store / "objects").is_dir()
    check_keep_store(store)  # an earlier --keep-store directory is taken again
