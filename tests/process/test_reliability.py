"""Reliability suite: faults, crashes, corruption, hostile input, control in every state, load.

Every test reports its figures (see the "kvtier reliability figures" section of the run) and
RELIABILITY.md lists them. Loopback only, bounded in time; the slowest cases are marked slow.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import suppress
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import require_mooncake
from crash_saver import run_iterations
from kvtier.engine.client import Client
from kvtier.errors import TaskTimeout, WorkerLost
from kvtier.layout.keys import KeyScheme, block_hashes
from kvtier.storage.file.store import FileStore
from kvtier.transport import tasks as t
from worker_helpers import FAST, WSPEC, block, engine, same

TESTS = Path(__file__).resolve().parents[1]  # the helpers live at the top of tests/


def hashes(n: int, seed: int) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 50_000, n * WSPEC.block_size)
    return block_hashes(tokens, WSPEC.block_size)


def _proc_figures(pid: int) -> tuple[int, int]:
    """(RSS in KiB, open file descriptors) of a process."""
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


# ---- 1. worker death -----------------------------------------------------------------------

SLOW_STORAGE = {"backend": "memory", "faults": {"latency_s": 1.0}}
TASKS = {
    "swap_out": lambda: [
        t.SwapOut(device_block_ids=[i % 30], host_block_ids=[i % 16]) for i in range(3000)
    ],
    "swap_in": lambda: [
        t.SwapIn(host_block_ids=[i % 16], device_block_ids=[i % 30]) for i in range(3000)
    ],
    "save": lambda: [t.Save(block_hashes=hashes(2, 1), device_block_ids=[1, 2])],
    "load": lambda: [t.Load(block_hashes=hashes(2, 1), device_block_ids=[1, 2])],
    "save_host": lambda: [t.SaveHost(block_hashes=hashes(2, 2), host_block_ids=[1, 2])],
    "load_host": lambda: [t.LoadHost(block_hashes=hashes(2, 2), host_block_ids=[1, 2])],
    "lookup": lambda: [t.Lookup(block_hashes=hashes(2, 3))],
}


@pytest.mark.slow
def test_worker_death_during_each_task_type(tmp_path, figures) -> None:
    worst = 0.0
    root = tmp_path / "store"
    with engine(tmp_path, storage={"backend": "file", "root": str(root)}) as (client, caches):
        kept = hashes(3, 99)
        assert client.save(kept, [5, 6, 7]).blocks == [5, 6, 7]
        want = [[block(c, b) for b in (5, 6, 7)] for c in caches]
        instance = client._ranks[0].endpoint.rsplit("/", 1)[1].split("-rank")[0]
    storage = {
        "backend": "file",
        "root": str(root),
        "faults": {"latency_s": 1.0},
    }  # storage tasks take a while: kill lands mid-task
    from kvtier.memory.device import DeviceCache, cache_name

    caches = [DeviceCache.create(WSPEC, cache_name(instance, r)) for r in range(2)]
    try:
        for kind, make in TASKS.items():
            client = Client.launch(
                WSPEC,
                2,
                storage,
                instance_id=instance,
                log_dir=tmp_path,
                client_options=FAST,
                num_host_blocks=16,
                staging_blocks=4,
            )
            try:
                futures = [client.submit(task) for task in make()]
                if kind.startswith(("save", "load", "lookup")):
                    time.sleep(0.05)  # storage tasks take 1 s: the kill lands mid-task
                killed = time.monotonic()
                os.kill(client.pids[1], signal.SIGKILL)
                failed = 0
                for f in futures:
                    try:
                        f.result(FAST["worker_timeout_s"] + 5)
                    except WorkerLost:
                        failed += 1
                took = time.monotonic() - killed
                assert failed >= 1, f"{kind}: the kill landed after every task finished"
                assert took < FAST["worker_timeout_s"], kind
                worst = max(worst, took)
                figures[f"{kind}_failed"] = failed
            finally:
                client.close()
        # A replacement set of workers continues, and the stored blocks are still valid.
        with Client.launch(
            WSPEC,
            2,
            {"backend": "file", "root": str(root)},
            instance_id=instance,
            client_options=FAST,
            num_host_blocks=16,
        ) as client:
            assert client.load(kept, [20, 21, 22]).blocks == [20, 21, 22]
            assert client.swap_out([1], [0]).status is t.Status.OK
        for cache, w in zip(caches, want):
            assert all(same(block(cache, 20 + i), w[i]) for i in range(3))
    finally:
        for cache in caches:
            cache.close()
    figures["worst_failure_s"] = worst


# ---- 2. engine death ------------------------------------------------------------------------


def test_engine_death_and_a_clean_restart(tmp_path, figures) -> None:
    from kvtier.worker.config import default_socket_dir

    instance = f"eng{uuid.uuid4().hex[:8]}"
    for attempt in range(2):  # the second start reuses every name the first one had
        engine_proc = subprocess.Popen(
            [sys.executable, str(TESTS / "engine_process.py"), str(tmp_path), "2", instance],
            stdout=subprocess.PIPE,
            text=True,
            cwd=TESTS,
        )
        pids = [int(p) for p in engine_proc.stdout.readline().split()]
        engine_proc.kill()
        engine_proc.wait(10)
        start = time.monotonic()
        while any(_alive(p) for p in pids) and time.monotonic() - start < 15:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids)
        figures[f"exit_after_engine_death_s_{attempt}"] = time.monotonic() - start
        assert not list(Path("/dev/shm").glob(f"kvtier-{instance}-*"))
        assert not list(default_socket_dir().glob(f"{instance}-*"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


# ---- 3. storage faults ------------------------------------------------------------------------


def _mount_tmpfs(path: Path, size: str) -> bool:
    """A private tmpfs at ``path`` (tmpfs's own default, 1777, is a root open to others, which
    kvtier refuses: anyone could make ``objects/`` there first)."""
    path.mkdir(parents=True, exist_ok=True)
    options = f"size={size},mode=0700"
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True
    )
    return mounted.returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_saves_queued_behind_a_save_blocked_on_a_slow_store_are_answered_at_once(
    tmp_path, figures
) -> None:
    """vLLM holds a request's blocks until its saves are answered. Behind a save blocked on a
    slow store (5 s per write here), the queued saves are answered ``cancelled`` while it still
    runs — not one write time each, in turn — nothing of them is written, and the running save
    still lands."""
    storage = {"backend": "memory", "faults": {"transfer_latency_s": 5.0}}
    with engine(tmp_path, world_size=1, storage=storage) as (client, _):
        h = hashes(8, seed=41)
        start = time.monotonic()
        first = client.submit(t.Save(block_hashes=h[:2], device_block_ids=[0, 1]))
        queued = [
            client.submit(t.Save(block_hashes=h[i : i + 2], device_block_ids=[i, i + 1]))
            for i in (2, 4, 6)
        ]
        answers = [f.result(timeout=60) for f in queued]
        shed_after = time.monotonic() - start
        running = not first.done()
        done = first.result(timeout=60)
        stored = [client.lookup(h[i : i + 2]) for i in (0, 2, 4, 6)]
    assert running, f"the queued saves were answered only after the first ({shed_after:.1f} s)"
    for a in answers:
        assert a.status is t.Status.CANCELLED and a.blocks == [], a
        assert "slow store" in a.message and "frees its blocks" in a.message, a.message
    assert done.status is t.Status.OK and done.blocks == [0, 1]
    assert stored == [2, 0, 0, 0]
    figures["queued_saves_answered_after_s"] = round(shed_after, 2)


def test_file_store_directory_removed(tmp_path, figures) -> None:
    root = tmp_path / "store"
    with engine(tmp_path, storage={"backend": "file", "root": str(root)}) as (client, _):
        h = hashes(3, 1)
        client.save(h, [1, 2, 3])
        subprocess.run(["rm", "-rf", str(root)], check=True)
        res = client.load(h, [10, 11, 12])
        assert res.blocks == [] and res.status is t.Status.PARTIAL  # a miss, not a crash
        start = time.monotonic()
        assert client.save(h, [1, 2, 3]).blocks == [1, 2, 3]  # recreated by itself
        figures["recovery_s"] = time.monotonic() - start
        assert client.load(h, [10, 11, 12]).blocks == [10, 11, 12]


def test_file_store_read_only_and_full(tmp_path, figures) -> None:
    """One rank: two ranks race for the last free bytes of a shared disk, and which one runs
    ahead decides the prefix both hold (0 when one rank took all the space first)."""
    mnt = tmp_path / "mnt"
    if not _mount_tmpfs(mnt, "3m"):
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    storage = {"backend": "file", "root": str(mnt)}
    try:
        with engine(tmp_path, 1, storage) as (client, _):
            h = hashes(400, 5)
            res = client.save(h, list(range(40)) * 10)  # far more than 3 MiB: the disk fills
            saved = len(res.blocks)
            figures["blocks_saved_before_full"] = saved
            assert res.status is t.Status.PARTIAL and 20 < saved < 400
            assert "stored" in res.message
            assert client.load(h[:20], list(range(20, 40))).status is t.Status.OK
            subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
            ro = client.save(hashes(2, 6), [1, 2])
            assert ro.blocks == [] and ro.status is t.Status.PARTIAL
            assert client.lookup(h[:5]) == 5  # reads still work on a read-only store
            subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
            start = time.monotonic()
            with FileStore(WSPEC, {"root": mnt}) as store:
                store.delete(store_keys(h, 1))
            assert client.save(hashes(2, 6), [1, 2]).blocks == [1, 2]  # recovered by itself
            figures["recovery_s"] = time.monotonic() - start
    finally:
        _umount(mnt)


def store_keys(h: list[bytes], world_size: int) -> list[str]:
    return [
        KeyScheme("default", WSPEC.fingerprint, rank=r).key(x) for r in range(world_size) for x in h
    ]


@pytest.mark.parametrize("via", ["wrapper", "mooncake"])
def test_storage_outage_then_recovery(tmp_path, figures, via) -> None:
    """Storage goes away under a running worker: loads give 0 blocks, saves fail, the worker
    stays up and recovers by itself when storage returns."""
    outage = tmp_path / "outage"  # the wrapper's storage is down while this file exists
    if via == "wrapper":
        storage = {"backend": "memory", "faults": {"unavailable_while": str(outage)}}
        master = None
    else:
        require_mooncake()
        from kvtier.storage.mooncake.local import LocalMaster

        master = LocalMaster().start()
        storage = master.config(global_segment_size=64 << 20, local_buffer_size=16 << 20)
    try:
        with engine(tmp_path, storage=storage) as (client, _):
            h = hashes(2, 8)
            assert client.save(h, [1, 2]).blocks == [1, 2]
            if master is not None:
                master.stop()
            else:
                outage.touch()
            res = client.load(h, [3, 4])
            assert res.status is t.Status.ERROR and "storage unavailable" in res.message
            assert client.save(h, [1, 2]).status is t.Status.ERROR
            assert client.swap_out([1], [0]).status is t.Status.OK  # the worker is up
            if master is not None:
                master.start()
            else:
                outage.unlink()
            start = time.monotonic()
            while client.save(hashes(1, 9), [5]).status is not t.Status.OK:
                assert time.monotonic() - start < 30, "no recovery"
                time.sleep(0.1)
            figures["recovery_s"] = time.monotonic() - start
    finally:
        if master is not None:
            master.stop()


def test_a_task_whose_client_gave_up_never_touches_its_blocks(tmp_path, figures) -> None:
    """The engine reuses the blocks of a task that timed out (vLLM recomputes a load's blocks,
    frees a finished request's). A store that stalls past the client's timeout: the stalled
    load, and the load queued behind it, are answered ``cancelled`` and leave their device
    blocks as they were — nothing is written after the client gave up. (Mooncake: a load goes
    through staging, where the transfer ends before the copy into the blocks.)"""
    require_mooncake()
    from kvtier.storage.mooncake.local import LocalMaster

    master = LocalMaster().start()
    storage = master.config(global_segment_size=64 << 20, local_buffer_size=16 << 20)
    storage["faults"] = {"transfer_latency_s": 2.0}  # every get and put waits 2 s
    try:
        with engine(tmp_path, world_size=1, storage=storage) as (client, (cache,)):
            h = hashes(4, 77)
            assert client.save(h, [1, 2, 3, 4]).blocks == [1, 2, 3, 4]
            want = [block(cache, b) for b in (1, 2, 3, 4)]
            before = {b: block(cache, b) for b in (20, 21, 22, 23)}
            start = time.monotonic()
            stalled = client.submit(t.Load(block_hashes=h[:2], device_block_ids=[20, 21]), 1.0)
            queued = client.submit(t.Load(block_hashes=h[2:], device_block_ids=[22, 23]), 1.0)
            for future in (stalled, queued):
                with pytest.raises(TaskTimeout):
                    future.result(timeout=30)
            gave_up_s = time.monotonic() - start
            # Loads run in order: this one's answer comes after the worker was done with both.
            assert client.load(h, [30, 31, 32, 33]).blocks == [30, 31, 32, 33]
            assert all(same(block(cache, 30 + i), want[i]) for i in range(4))  # loads do write
            after = {b: block(cache, b) for b in before}
            stats = client.control("stats").per_rank[0].data["tasks"]
        untouched = [b for b in before if same(after[b], before[b])]
        assert untouched == list(before), f"blocks written after the client gave up: {after}"
        assert stats["load"]["cancelled"] == 2, stats["load"]
        figures["client_gave_up_after_s"] = round(gave_up_s, 2)
        figures["blocks_written_after_it"] = len(before) - len(untouched)
    finally:
        master.stop()


# ---- 4. corruption ----------------------------------------------------------------------------


def test_bit_flips_in_stored_objects_are_all_detected(tmp_path, figures) -> None:
    root = tmp_path / "store"
    rng = random.Random(4)
    with engine(tmp_path, storage={"backend": "file", "root": str(root)}) as (client, caches):
        prefixes = [hashes(6, 100 + i) for i in range(10)]
        for h in prefixes:
            assert client.save(h, [1, 2, 3, 4, 5, 6]).status is t.Status.OK
        injected = {}  # prefix index -> first corrupted block
        with FileStore(WSPEC, {"root": root}) as store:
            for i in rng.sample(range(10), 6):
                pos = rng.randrange(6)
                key = KeyScheme("default", WSPEC.fingerprint, rank=rng.randrange(2)).key(
                    prefixes[i][pos]
                )
                data = bytearray(store.read_object(key))
                bit = rng.randrange(len(data) * 8)
                data[bit // 8] ^= 1 << (bit % 8)
                store.write_object(key, bytes(data))
                injected[i] = pos
        want = [block(c, 1) for c in caches]
        for i, h in enumerate(prefixes):
            res = client.load(h, [20, 21, 22, 23, 24, 25])
            expected = injected.get(i, 6)
            assert len(res.blocks) == expected, (i, res)  # stops right before the bad block
            if expected:
                assert all(same(block(c, 20), w) for c, w in zip(caches, want))
        stats = [client.control("stats").per_rank[r].data["storage"] for r in range(2)]
        detected = sum(s["corrupt"] for s in stats)
        figures["injected"] = len(injected)
        figures["detected"] = detected
        assert detected == len(injected)


@pytest.mark.parametrize("backend", ["memory", "file"])  # Mooncake: tests/cluster
def test_corruption_through_the_wrapper_on_every_local_backend(tmp_path, figures, backend) -> None:
    storage = {"backend": backend, "faults": {"corrupt_rate": 0.3, "seed": 11}}
    if backend == "file":
        storage["root"] = str(tmp_path / "store")
    with engine(tmp_path, world_size=1, storage=storage) as (client, caches):
        loaded = 0
        for i in range(20):
            h = hashes(4, 200 + i)
            client.save(h, [1, 2, 3, 4])
            res = client.load(h, [10, 11, 12, 13])
            loaded += len(res.blocks)
            for j, dev in enumerate(res.blocks):
                assert same(block(caches[0], dev), block(caches[0], 1 + j))
        stats = client.control("stats").per_rank[0].data["storage"]
        figures["blocks_loaded_and_verified"] = loaded
        figures["detected"] = stats["corrupt"]
        assert stats["corrupt"] > 0 and loaded < 80


# ---- 5. crash during save ---------------------------------------------------------------------


@pytest.mark.slow
def test_sigkill_during_saves_50_times(tmp_path, figures) -> None:
    rows = run_iterations(tmp_path, 50, seed=7, timeout_s=600)
    assert all(r["visible"] == r["whole"] and r["prefix_ok"] and r["tmp_left"] == 0 for r in rows)
    figures["kills"] = sum(r["killed"] for r in rows)
    figures["visible_objects_checked"] = sum(r["visible"] for r in rows)
    figures["partial_objects_seen"] = sum(r["visible"] - r["whole"] for r in rows)


# ---- 6. hostile input -------------------------------------------------------------------------

TAGS = [
    "swap_out",
    "swap_in",
    "save",
    "load",
    "save_host",
    "load_host",
    "lookup",
    "control",
    "hello",
    "heartbeat",
    "result",
    "welcome",
    "bundle",
    "explode",
    "",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=40),
)
values = st.recursive(
    scalars,
    lambda c: st.lists(c, max_size=5) | st.dictionaries(st.text(max_size=10), c, max_size=5),
    max_leaves=20,
)
HUGE = "<a list of 100,000 ids>"
id_lists = st.one_of(
    st.lists(st.integers(-5, 100), max_size=20),
    st.just(HUGE),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
)
task_like = st.fixed_dictionaries(
    {"type": st.sampled_from(TAGS), "task_id": st.integers(1, 2**31)},
    optional={
        "device_block_ids": id_lists | values,
        "host_block_ids": id_lists | values,
        "block_hashes": st.lists(st.binary(max_size=40), max_size=5) | values,
        "method": st.sampled_from(["reboot", "", "PAUSE", "stats"]) | values,
        "args": st.dictionaries(st.text(max_size=8), values, max_size=3) | values,
        "protocol_version": st.integers(-3, 5),
        "extra": values,
        "items": st.lists(st.binary(max_size=40).map(msgspec.Raw), max_size=3) | values,
    },
)


def _encode(d: dict) -> bytes:
    return msgspec.msgpack.encode(
        {k: list(range(100_000)) if v == HUGE else v for k, v in d.items()}
    )


hostile = st.one_of(
    st.binary(max_size=300),
    task_like.map(_encode),
    task_like.map(lambda d: _encode(d)[:-1]),  # truncated
    values.map(msgspec.msgpack.encode),
)


def test_fuzzing_a_worker_socket(tmp_path, figures) -> None:
    with engine(tmp_path, world_size=1) as (client, caches):
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(client._ranks[0].endpoint)
        counts = {"sent": 0, "answered": 0}

        @settings(
            max_examples=1200, deadline=None, database=None, suppress_health_check=list(HealthCheck)
        )
        @given(payload=hostile)
        def fuzz(payload: bytes) -> None:
            if _is_control_that_changes_state(payload):
                return
            counts["sent"] += 1
            sock.send(payload)
            if _expects_answer(payload):
                assert sock.poll(5000), f"no answer to {payload[:80]!r}"
            while sock.poll(0 if not counts["answered"] else 1):
                sock.recv()
                counts["answered"] += 1
            client.ping()  # keep the engine heartbeat going; the worker must answer it

        fuzz()
        sock.close(0)
        ctx.term()
        figures.update(counts)
        assert counts["sent"] >= 1000
        # Alive and correct afterwards.
        want = block(caches[0], 3)
        assert client.swap_out([3], [15]).status is t.Status.OK
        assert client.swap_in([15], [39]).status is t.Status.OK
        assert same(block(caches[0], 39), want)
        assert client.control("stats").per_rank[0].data["state"] == "running"


def _decoded(payload: bytes):
    with suppress(Exception):
        return msgspec.msgpack.decode(payload)
    return None


def _expects_answer(payload: bytes, bundled: bool = False) -> bool:
    """What the worker promises: tasks, control, hello and heartbeats are answered; a
    malformed message is answered when it carries a task id; anything else is dropped. A
    bundle's messages are each answered as if sent alone (a bundle inside one is malformed)."""
    try:
        message = t.decode(payload)
        if isinstance(message, t.Bundle) and bundled:
            raise ValueError("nested")
    except Exception:
        raw = _decoded(payload)
        return isinstance(raw, dict) and type(raw.get("task_id")) is int
    if isinstance(message, t.Bundle):
        return any(_expects_answer(bytes(item), bundled=True) for item in message.items)
    return not isinstance(message, (t.Result, t.Welcome))


def _is_control_that_changes_state(payload: bytes) -> bool:
    """Valid pause/sleep/shutdown would (rightly) stop serving; the fuzz keeps to the rest."""
    with suppress(Exception):
        message = t.decode(payload)
        if isinstance(message, t.Bundle):
            return any(_is_control_that_changes_state(bytes(item)) for item in message.items)
        return isinstance(message, t.Shutdown) or (
            isinstance(message, t.Control) and message.method in {"pause", "sleep"}
        )
    return False


# ---- 7. control in every state ----------------------------------------------------------------


def test_control_in_every_state(tmp_path, figures) -> None:
    slow = {"backend": "memory", "faults": {"latency_s": 0.3}}
    with engine(tmp_path, storage=slow) as (client, _):
        submitted, answered = 0, 0
        futures = []

        def submit(task):
            nonlocal submitted
            submitted += 1
            futures.append(client.submit(task))

        codes = [client.control(m).code for m in ("pause", "pause")]  # pause twice
        for i in range(5):
            submit(t.SwapOut(device_block_ids=[i], host_block_ids=[i]))
        codes.append(client.control("update_weights", version="RL-STEP9").code)  # while paused
        codes.append(client.control("resume").code)
        codes.append(client.control("resume").code)  # resume while running
        submit(t.Load(block_hashes=hashes(3, 1), device_block_ids=[1, 2, 3]))  # a long load ...
        time.sleep(0.05)
        codes.append(client.control("sleep").code)  # ... sleep waits for it
        submit(
            t.SwapOut(device_block_ids=[1], host_block_ids=[1])
        )  # refused while sleeping, with an answer
        codes += [client.control("wakeup").code, client.control("wakeup").code]
        codes.append(client.control("pause").code)
        for i in range(3):
            submit(
                t.SwapIn(host_block_ids=[i], device_block_ids=[i])
            )  # held, then shutdown while paused
        time.sleep(0.2)
        client.close()
        for f in futures:
            with suppress(Exception):
                f.result(10)
            answered += f.done()
        statuses = [f.result().status.value for f in futures if f.exception() is None]
        figures["submitted"] = submitted
        figures["answered"] = answered
        assert codes == [200] * len(codes)
        assert answered == submitted
        assert statuses[:5] == ["ok"] * 5 and statuses[6] == "error"
        assert statuses[-3:] == ["cancelled"] * 3


# ---- 8. sustained load ------------------------------------------------------------------------


@pytest.mark.slow
def test_sustained_load(tmp_path, figures) -> None:
    with engine(tmp_path, storage={"backend": "memory"}) as (client, _):
        for i in range(200):  # warm up
            client.swap_out([i % 30], [i % 16])
        before = [_proc_figures(p) for p in client.pids]
        latencies: list[float] = []
        lock = threading.Lock()
        errors = []

        def run(offset: int) -> None:
            mine = []
            try:
                for i in range(5000):
                    task = (
                        t.SwapOut(
                            device_block_ids=[offset + i % 15], host_block_ids=[offset // 2 + i % 8]
                        )
                        if i % 3
                        else t.Lookup(block_hashes=hashes(1, i % 7))
                    )
                    start = time.perf_counter()
                    client.submit(task).result(30)
                    mine.append(time.perf_counter() - start)
            except Exception as e:
                errors.append(e)
            with lock:
                latencies.extend(mine)

        threads = [threading.Thread(target=run, args=(o,)) for o in (0, 15)]
        start = time.monotonic()
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
        took = time.monotonic() - start
        after = [_proc_figures(p) for p in client.pids]
        assert not errors, errors[0]
        assert len(latencies) == 10_000
        latencies.sort()
        figures["tasks_answered"] = len(latencies)
        figures["seconds"] = took
        figures["p50_ms"] = latencies[5000] * 1e3
        figures["p99_ms"] = latencies[9900] * 1e3
        for r, ((rss0, fd0), (rss1, fd1)) in enumerate(zip(before, after)):
            figures[f"rank{r}_rss_kib"] = f"{rss0}->{rss1}"
            figures[f"rank{r}_fds"] = f"{fd0}->{fd1}"
            assert fd1 <= fd0 + 2
            assert rss1 < rss0 * 1.25 + 20_000


# ---- 9. weight versions -----------------------------------------------------------------------


def test_no_hits_across_a_weight_update(tmp_path, figures) -> None:
    with engine(tmp_path, world_size=1, storage={"backend": "memory"}) as (client, _):
        assert client.control("update_weights", version="RL-STEP1").code == 200
        prefixes = [hashes(3, 1000 + i) for i in range(100)]
        for h in prefixes:
            assert client.save(h, [1, 2, 3]).status is t.Status.OK
        assert client.control("update_weights", version="RL-STEP2").code == 200
        hits = sum(client.lookup(h) for h in prefixes)
        loads = sum(len(client.load(h, [4, 5, 6]).blocks) for h in prefixes)
        figures["prefixes"] = len(prefixes)
        figures["hits_after_update"] = hits + loads
        assert hits == 0 and loads == 0


def test_a_partial_load_never_leaves_failed_bytes_in_device_blocks(tmp_path, figures) -> None:
    """The block that failed its checksum holds the engine's old bytes (verified in staging,
    never copied) or zeros (read straight into the cache, verified there, zeroed) — never the
    bytes that failed; blocks past it hold their old bytes or their own verified bytes.
    bytes_moved counts what was copied."""
    root = tmp_path / "store"
    with engine(tmp_path, world_size=1, storage={"backend": "file", "root": str(root)}) as (
        client,
        (cache,),
    ):
        h = hashes(4, 77)
        assert client.save(h, [1, 2, 3, 4]).status is t.Status.OK
        with FileStore(WSPEC, {"root": root}) as store:
            key = KeyScheme("default", WSPEC.fingerprint, rank=0).key(h[2])
            data = bytearray(store.read_object(key))
            data[-1] ^= 0x40  # the payload's last byte: only the copy's checksum can see it
            store.write_object(key, bytes(data))
        sentinel = 0xAB
        for b in (20, 21, 22, 23):
            for row in cache.tensors:
                for x in row:
                    x[b].view(torch.uint8).fill_(sentinel)
        res = client.load(h, [20, 21, 22, 23])
        assert res.status is t.Status.PARTIAL and res.blocks == [20, 21]
        failed = [x[22].view(torch.uint8) for r in cache.tensors for x in r]
        assert all((x == sentinel).all() for x in failed) or all((x == 0).all() for x in failed)
        source = block(cache, 4)
        assert same(block(cache, 23), source) or all(
            (x[23].view(torch.uint8) == sentinel).all() for r in cache.tensors for x in r
        )
        copied = res.bytes_moved // WSPEC.block_bytes
        assert res.bytes_moved % WSPEC.block_bytes == 0 and copied in (2, 3)
        figures["blocks_copied"] = copied
