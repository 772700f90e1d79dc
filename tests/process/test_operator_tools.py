"""`kvtier store` on a real store and `kvtier status` against live workers, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from kvtier.layout.keys import KeyScheme, block_hashes
from kvtier.memory.host import HostPool
from kvtier.storage.file.store import FileStore
from kvtier.testing.contract import CONTRACT_SPEC
from kvtier.transport import tasks as t
from worker_helpers import FAST, engine, hashes, lone_worker_flags


def kvtier(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.ops.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def json_lines(out: subprocess.CompletedProcess) -> list[dict]:
    assert out.returncode in (0, 1), out.stderr
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.fixture
def store_root(tmp_path):
    """Objects of two namespaces x two versions (3 + 2 + 4 + 1, rank 0 and 1 for the first),
    one corrupted payload and one foreign file."""
    root = tmp_path / "store"
    groups = {("llama", "RL-STEP1"): 3, ("llama", "RL-STEP2"): 2, ("qwen", "RL-STEP1"): 4}
    groups[("qwen", "")] = 1
    keys: dict[tuple[str, str], list[str]] = {}
    with FileStore(CONTRACT_SPEC, {"root": root}) as store, HostPool(CONTRACT_SPEC, 8) as pool:
        for i in range(8):
            pool.block(i).fill_(i + 1)
        for (namespace, version), n in groups.items():
            rank = 1 if (namespace, version) == ("llama", "RL-STEP1") else 0
            scheme = KeyScheme(namespace, CONTRACT_SPEC.fingerprint, rank, version)
            tokens = np.arange(n * CONTRACT_SPEC.block_size) + len(keys) * 1000
            keys[(namespace, version)] = scheme.keys(block_hashes(tokens, CONTRACT_SPEC.block_size))
            blocks = [pool.block(i) for i in range(n)]
            assert store.put_from(keys[(namespace, version)], blocks) == [True] * n
        corrupt = store._path(keys[("qwen", "RL-STEP1")][2])
    data = bytearray(corrupt.read_bytes())
    data[100] ^= 0x10  # a payload bit: only a full read can see it
    corrupt.write_bytes(bytes(data))
    (root / "objects" / "ab" / "README").write_text("not ours")
    return root, keys, corrupt


def test_store_stats_counts_every_group(store_root) -> None:
    root, _, _ = store_root
    rows = json_lines(kvtier("store", "stats", str(root), "--json"))
    groups = {(r["namespace"], r["version"]): (r["objects"], r["ranks"]) for r in rows[:-1]}
    assert groups == {
        ("llama", "RL-STEP1"): (3, "1"),
        ("llama", "RL-STEP2"): (2, "0"),
        ("qwen", "RL-STEP1"): (4, "0"),  # the corrupt payload is invisible to a header scan
        ("qwen", ""): (1, "0"),  # JSON carries the empty version as it is
    }
    assert rows[-1] == {"total_objects": 10, "bad_headers": 0, "foreign": 1}
    text = kvtier("store", "stats", str(root)).stdout
    assert "10 objects" in text and "llama" in text and "1 foreign entry" in text
    assert '""' in text  # the table shows it


def test_stored_text_never_drives_the_operators_terminal(tmp_path) -> None:
    """A store writer named a namespace with terminal escapes: `kvtier store stats` cleared the
    operator's screen and printed a fake "store healthy" line."""
    from kvtier.ops.table import printable

    root = tmp_path / "store"
    evil = "x\x1b[2J\x1b[H\rstore healthy\u202e"
    scheme = KeyScheme("ns", CONTRACT_SPEC.fingerprint, 0, "v1")
    keys = scheme.keys(block_hashes(np.arange(CONTRACT_SPEC.block_size), CONTRACT_SPEC.block_size))
    fields = keys[0].split(":")  # a writer of the store bypasses KeyScheme's checks
    fields[1], fields[2] = evil, "v\x07"
    keys = [":".join(fields)]
    with FileStore(CONTRACT_SPEC, {"root": root}) as store, HostPool(CONTRACT_SPEC, 1) as pool:
        assert store.put_from(keys, [pool.block(0)]) == [True]
    out = kvtier("store", "stats", str(root))
    assert out.returncode == 0, out.stderr
    assert not any(c in out.stdout for c in "\x1b\r\x07\u202e")
    assert "\\x1b[2J" in out.stdout and "\\u202e" in out.stdout  # shown, escaped
    assert json_lines(kvtier("store", "stats", str(root), "--json"))[0]["namespace"] == evil
    assert printable("a\nb\x9bc", keep_newlines=True) == "a\nb\\x9bc"


def test_store_verify_finds_exactly_the_corrupt_object_and_repair_removes_only_it(
    store_root,
) -> None:
    root, _, corrupt = store_root
    out = kvtier("store", "verify", str(root), "--json")
    assert out.returncode == 1  # something is corrupt and was not repaired
    summary = json.loads(out.stdout)
    assert (summary["sound"], summary["corrupt"], summary["foreign"]) == (9, 1, 1)
    assert summary["problems"][0] == {
        "path": str(corrupt),
        "problem": "payload checksum mismatch",
    }
    before = sorted(p.name for p in root.rglob("*") if p.is_file())
    out = kvtier("store", "verify", str(root), "--repair")
    assert out.returncode == 0, out.stderr
    assert "9 sound, 1 corrupt, 1 foreign; removed 1 corrupt" in out.stdout
    after = sorted(p.name for p in root.rglob("*") if p.is_file())
    assert set(before) - set(after) == {corrupt.name}  # the foreign file stays
    assert json.loads(kvtier("store", "verify", str(root), "--json").stdout)["corrupt"] == 0


def test_store_gc_removes_what_is_selected_and_a_dry_run_nothing(store_root) -> None:
    root, keys, _ = store_root
    files = lambda: sorted(root.rglob("*.kvb"))  # noqa: E731
    everything = files()
    out = json.loads(
        kvtier("store", "gc", str(root), "--namespace", "llama", "--dry-run", "--json").stdout
    )
    assert (out["selected"], out["removed"]) == (5, 0)
    assert files() == everything
    out = json.loads(
        kvtier(
            "store", "gc", str(root), "--namespace", "llama", "--version", "RL-STEP1", "--json"
        ).stdout
    )
    assert (out["selected"], out["removed"]) == (3, 3)
    with FileStore(CONTRACT_SPEC, {"root": root}) as store:
        for (namespace, version), group in keys.items():
            gone = (namespace, version) == ("llama", "RL-STEP1")
            assert [store._path(k).exists() for k in group] == [not gone] * len(group)
    # Down to a capacity of 3 objects, least recently used first.
    now = time.time()
    remaining = files()
    for age, path in enumerate(reversed(remaining)):
        os.utime(path, (now - 100 * age, now - 100 * age))
    object_bytes = remaining[0].stat().st_size
    out = json.loads(
        kvtier("store", "gc", str(root), "--capacity", str(3 * object_bytes), "--json").stdout
    )
    assert out["removed"] == len(remaining) - 3
    assert files() == sorted(remaining[-3:])  # the three most recently used stay
    assert (root / "objects" / "ab" / "README").exists()
    assert kvtier("store", "gc", str(root)).returncode == 2  # nothing said: nothing removed


def test_status_shows_each_state_of_live_workers(tmp_path) -> None:
    with engine(tmp_path, world_size=2) as (client, _):
        assert client.save(hashes(2), [1, 2]).status is t.Status.OK
        instance = client._launch.configs[0].instance_id  # type: ignore[union-attr]
        for control, state in ((None, "running"), ("pause", "paused"), ("resume", "running")):
            if control:
                assert client.control(control).code == 200
            ranks = json_lines(kvtier("status", instance, "--json"))
            assert [r["rank"] for r in ranks] == [0, 1]
            assert {r["state"] for r in ranks} == {state}
            assert all(r["tasks"]["save"]["tasks"] == 1 for r in ranks)
        assert client.control("sleep").code == 200
        assert {r["state"] for r in json_lines(kvtier("status", instance, "--json"))} == {
            "sleeping"
        }
        assert client.control("wakeup").code == 200
        text = kvtier("status", instance).stdout
        assert "2 rank(s)" in text and "running" in text and "save" in text
        assert kvtier("status", "no-such-instance").returncode == 2


def test_an_observer_gets_stats_only_and_keeps_no_worker_alive(tmp_path) -> None:
    """`kvtier status --watch` must not stand in for a dead engine."""
    from kvtier.engine.client import Client
    from kvtier.worker.config import endpoint_for

    instance = f"obs{uuid.uuid4().hex[:6]}"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtier.ops.cli",
            "serve",
            *lone_worker_flags(instance),
            "--engine-timeout-s",
            "3",
            "--start-timeout-s",  # no engine ever says hello: this bounds the worker's wait
            "3",
        ],
        stderr=subprocess.DEVNULL,
    )
    try:
        observer = Client.connect([endpoint_for(instance, 0)], observer=True, **FAST)
        start = time.monotonic()
        try:
            assert observer.control("stats").per_rank[0].data["state"] == "running"
            refused = observer.swap_out([1], [0])
            assert refused.status is t.Status.ERROR and "observer" in refused.message
            assert proc.wait(20) == 3  # exits on start_timeout_s, the observer's heartbeats or not
        finally:
            observer.close()
        assert 2.5 <= time.monotonic() - start < 15
    finally:
        proc.kill()


def _plant_size(path, payload_length: int) -> None:
    """Rewrite the object at ``path`` as a sparse file whose (self-consistent) header claims
    ``payload_length`` payload bytes: a few KiB on disk."""
    import xxhash

    from kvtier.storage import format as fmt

    data = path.read_bytes()
    fields = list(fmt._BODY.unpack_from(data))
    fields[5] = payload_length
    body = fmt._BODY.pack(*fields)
    key = data[-fields[7] :]
    with open(path, "wb") as f:
        f.write(body + fmt._CHECK.pack(xxhash.xxh3_64_intdigest(body)))
        f.truncate(fmt.HEADER_BYTES + payload_length)
        f.seek(0, os.SEEK_END)
        f.write(key)


def test_store_verify_never_allocates_what_a_planted_header_claims(store_root) -> None:
    """A sparse 8 KiB file claiming a multi-GiB payload made `verify` allocate it (3 GiB RSS;
    a MemoryError traceback under a memory limit)."""
    import resource

    root, keys, corrupt = store_root
    with FileStore(CONTRACT_SPEC, {"root": root}) as store:
        huge = store._path(keys[("llama", "RL-STEP1")][0])
        large = store._path(keys[("llama", "RL-STEP2")][0])
    _plant_size(huge, 3 << 30)
    _plant_size(large, 900 << 20)  # under the absolute bound: its layout gives it away

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (768 << 20, 768 << 20))

    out = subprocess.run(
        [sys.executable, "-m", "kvtier.ops.cli", "store", "verify", str(root), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
    )
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    summary = json_lines(out)[-1]
    problems = {p["path"]: p["problem"] for p in summary["problems"]}
    assert "claims" in problems[str(huge)] and "claims" in problems[str(large)]
    assert str(corrupt) in problems and summary["corrupt"] == 3
