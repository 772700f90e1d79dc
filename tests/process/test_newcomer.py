"""What a newcomer ran into, as the kvtier command answers it now: each a real process, each
refused or said at once, in one line that names the option, before anything starts."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import uuid
from pathlib import Path

from test_cli import _left_by, _one_line_error, _private_dirs, kvtier

SPAWN_RECORDER = """
import sys

def _record(event, args):
    if event == "subprocess.Popen":
        with open(RECORD, "a") as f:
            f.write(" ".join(map(str, args[1] or ())) + "\\n")

sys.addaudithook(_record)
"""


def _demo(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``kvtier demo FLAGS`` in the test's own directories; its outcome, and the command line
    of every process it spawned (an audit hook in its interpreter records each one)."""
    instance = f"new{uuid.uuid4().hex[:8]}"
    site = tmp_path.with_name(tmp_path.name + "-spawn-site")  # beside what _left_by checks
    record = site / "spawned.txt"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(f"RECORD = {str(record)!r}\n{SPAWN_RECORDER}")
    record.unlink(missing_ok=True)
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    out = kvtier(
        "demo",
        "--instance-id",
        instance,
        *flags,
        env={**_private_dirs(tmp_path), "PYTHONPATH": path},
    )
    assert _left_by(instance, tmp_path) == []
    return out, record.read_text().splitlines() if record.exists() else []


def _refused_before_anything_started(spawned: list[str]) -> None:
    """No worker was started before the refusal: the regressions these tests catch started
    workers first (5.7 s, 21.7 s idle), which a bound on the time could not tell from a busy
    machine's startup."""
    workers = [line for line in spawned if " serve " in f" {line} "]
    assert workers == [], f"refused only after starting workers: {workers}"


def test_options_are_never_abbreviated(tmp_path) -> None:
    """`--user 3` was taken as `--users 3`."""
    out, _ = _demo(tmp_path, "--user", "3")
    assert out.returncode == 2 and "unrecognized arguments: --user" in out.stderr, out.stderr
    out = kvtier("bench", "latency", "--rank", "1")
    assert out.returncode == 2 and "unrecognized arguments: --rank" in out.stderr, out.stderr


def test_mooncake_options_need_the_mooncake_backend(tmp_path) -> None:
    """`--mooncake-master` was silently ignored with the file backend."""
    out, spawned = _demo(tmp_path, "--mooncake-master", "127.0.0.1:50051")
    _one_line_error(out, "mooncake_master:", "--backend mooncake")
    out, _ = _demo(tmp_path, "--backend", "memory", "--mooncake-metadata", "http://x")
    _one_line_error(out, "mooncake_metadata:", "--backend mooncake")
    _refused_before_anything_started(spawned)


def test_a_bad_instance_id_is_refused_before_any_worker_starts(tmp_path) -> None:
    """It named an internal name after 5.7 s of starting workers."""
    out, spawned = _demo(tmp_path, "--instance-id", "two words")
    _one_line_error(out, "instance_id:", "letters, digits")
    assert "worker" not in out.stderr.lower()
    _refused_before_anything_started(spawned)


def test_keep_store_does_not_make_missing_parents(tmp_path) -> None:
    """`--keep-store /nonexistent/dir/x` made the whole path, silently."""
    target = tmp_path / "nonexistent" / "dir" / "x"
    out, _ = _demo(tmp_path, "--keep-store", str(target))
    _one_line_error(out, "keep_store:", str(target.parent), "does not exist")
    assert not (tmp_path / "nonexistent").exists()


def test_many_more_ranks_than_cores_is_refused_with_the_limit(tmp_path) -> None:
    """`--ranks 64` on 2 cores crawled without a word."""
    cores = len(os.sched_getaffinity(0))
    ranks = min(64, 4 * cores + 1)
    if ranks <= 4 * cores:
        return  # a machine with more than 16 cores takes 64 ranks
    out, spawned = _demo(tmp_path, "--ranks", str(ranks))
    _one_line_error(out, "ranks:", f"{cores} CPU core", f"at most {4 * cores}")
    _refused_before_anything_started(spawned)


def test_a_mooncake_master_that_is_down_is_found_before_workers_start(tmp_path) -> None:
    """It was found after 21.7 s of starting workers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens on it once closed
    out, spawned = _demo(
        tmp_path, "--backend", "mooncake", "--mooncake-master", f"127.0.0.1:{port}"
    )
    _one_line_error(out, "mooncake_master:", f"127.0.0.1:{port}", "mooncake_master")
    _refused_before_anything_started(spawned)


def test_help_pages_show_no_empty_or_repeated_defaults() -> None:
    """ "(default: None)" twice, and "(default: 2) (default: 2.0)" on `bench latency --seconds`."""
    for command in (["demo"], ["status"], ["store", "stats"], ["bench", "latency"]):
        out = kvtier(*command, "--help")
        assert out.returncode == 0, out.stderr
        assert "(default: None)" not in out.stdout, command
        for option in re.split(r"\n  (?=-)", out.stdout):  # one option's help at a time
            assert option.count("(default:") <= 1, (command, option)


def test_store_stats_json_gives_numbers_not_words(tmp_path) -> None:
    """`"last_used": "2s ago"` in JSON: a program reads seconds and bytes."""
    code = (
        "import sys, torch\n"
        "from kvtier import HostPool\n"
        "from kvtier.layout.keys import KeyScheme\n"
        "from kvtier.storage.file.store import FileStore\n"
        "from worker_helpers import WSPEC, hashes\n"
        "keys = KeyScheme('model', WSPEC.fingerprint, 0).keys(hashes(3))\n"
        "with FileStore(WSPEC, {'root': sys.argv[1]}) as store, HostPool(WSPEC, 3) as pool:\n"
        "    assert all(store.put_from(keys, [pool.block(i) for i in range(3)]))\n"
    )
    tests = Path(__file__).resolve().parents[1]
    subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "store")], check=True, cwd=tests, timeout=120
    )
    out = kvtier("store", "stats", str(tmp_path / "store"), "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    group = rows[0]
    assert group["objects"] == 3 and isinstance(group["bytes"], int)
    assert isinstance(group["last_used_s"], float) and 0 <= group["last_used_s"] < 600
    assert isinstance(group["last_used_unix"], float)
    assert not any(isinstance(v, str) and v.endswith(" ago") for v in group.values())
