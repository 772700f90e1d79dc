"""kvtier as LMCache's L2 adapter, created and driven by LMCache's own code (its plugin factory,
its benchmark's keys and memory objects, its event fds, its ``lmcache bench l2``): bytes
round-trip equal; a stale weight version, a corrupt object and another rank are misses; the
store's bound holds and LMCache's per-salt accounting follows kvtier's evictions."""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_peer

require_peer("lmcache")

from lmcache.cli.commands.bench.l2_adapter_bench.data import (  # noqa: E402
    make_aligned_tensor,
    make_memory_objects,
    make_object_keys,
)
from lmcache.v1.distributed.api import ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import (  # noqa: E402
    parse_args_to_l2_adapters_config,
)
from lmcache.v1.platform import consume_fd  # noqa: E402

from kvtier.hosted import shelf as shelf_module  # noqa: E402
from kvtier.lmcache import KvtierL2Adapter  # noqa: E402

OBJECT_BYTES = 64 * 1024
# A task is a few file operations: this bounds a wait on a busy machine, never a pass.
TASK_TIMEOUT_S = 30.0


def adapter_json(root: Path, backend: str = "file", **params: object) -> str:
    storage = {"backend": "file", "root": str(root)} if backend == "file" else {"backend": backend}
    return json.dumps(
        {
            "type": "plugin",
            "module_path": "kvtier.lmcache",
            "class_name": "KvtierL2Adapter",
            "adapter_params": {"storage": storage, **params},
        }
    )


def make_adapter(root: Path, backend: str = "file", **params: object) -> KvtierL2Adapter:
    """The adapter as LMCache creates it: from its JSON, through its plugin factory."""
    config = parse_args_to_l2_adapters_config(
        argparse.Namespace(l2_adapter=[adapter_json(root, backend, **params)])
    )
    adapter = create_l2_adapter(config.adapters[0])
    assert isinstance(adapter, KvtierL2Adapter)
    return adapter


def wait(fd: int, poll) -> object:
    """Wait on an adapter's event fd until ``poll()`` answers (as LMCache's controllers do)."""
    while True:
        result = poll()
        if result is not None:
            return result
        ready, _, _ = select.select([fd], [], [], TASK_TIMEOUT_S)
        assert ready, "no task finished within TASK_TIMEOUT_S"
        consume_fd(fd)


def store(adapter, keys, objects) -> int:
    task = adapter.submit_store_task(keys, objects)
    done = wait(
        adapter.get_store_event_fd(),
        lambda: adapter.pop_completed_store_tasks().get(task),
    )
    return int(done)


def lookup(adapter, keys) -> list[int]:
    task = adapter.submit_lookup_and_lock_task(keys, {})
    bitmap = wait(
        adapter.get_lookup_and_lock_event_fd(),
        lambda: adapter.query_lookup_and_lock_result(task),
    )
    return list(bitmap.get_indices_list())


def load(adapter, keys, objects) -> list[int]:
    task = adapter.submit_load_task(keys, objects)
    bitmap = wait(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task))
    return list(bitmap.get_indices_list())


def buffers(n: int, fill_offset: int = 0):
    """LMCache's benchmark objects: ``n`` views of one buffer, object i filled with i+offset."""
    backing = make_aligned_tensor(n * OBJECT_BYTES)
    return make_memory_objects(backing, n, OBJECT_BYTES, 0, fill_offset)


def randomize(objects, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    for obj in objects:
        raw = obj.raw_tensor
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


# The file store reads on its own threads (a load is handed to them at once); the memory
# store does not (a load runs on the adapter's threads).
@pytest.mark.parametrize("backend", ["file", "memory"])
def test_lmcache_creates_it_and_pages_round_trip_byte_exact(tmp_path, backend):
    adapter = make_adapter(tmp_path, backend)
    try:
        assert adapter._shelf(OBJECT_BYTES).starts_transfers == (backend == "file")
        keys = make_object_keys(12)
        objects = buffers(12)
        randomize(objects, seed=1)
        assert store(adapter, keys, objects) == 12 * OBJECT_BYTES
        assert lookup(adapter, keys) == list(range(12))
        assert adapter.locked_keys() == 12
        adapter.submit_unlock(keys)
        assert adapter.locked_keys() == 0
        out = buffers(12, fill_offset=99)
        assert load(adapter, keys, out) == list(range(12))
        for a, b in zip(objects, out, strict=True):
            assert bytes(a.byte_array) == bytes(b.byte_array)
        # A second store of the same keys writes nothing and is still a success.
        assert store(adapter, keys, objects) == 0
        # Keys never stored: lookup and load miss.
        unknown = make_object_keys(3, key_offset=1000)
        assert lookup(adapter, unknown) == []
        assert load(adapter, unknown, buffers(3)) == []
        # Objects of two sizes in one load: each size from its own shelf.
        small = make_memory_objects(make_aligned_tensor(2 * 4096), 2, 4096, 0, 5)
        assert store(adapter, make_object_keys(2, key_offset=500), small) == 2 * 4096
        mixed_keys = [keys[0], *make_object_keys(2, key_offset=500), keys[1]]
        mixed = [buffers(1, 50)[0], *make_memory_objects(make_aligned_tensor(8192), 2, 4096, 0)]
        mixed.append(buffers(1, 51)[0])
        assert load(adapter, mixed_keys, mixed) == [0, 1, 2, 3]
        for got, want in zip(mixed, [objects[0], *small, objects[1]], strict=True):
            assert bytes(got.byte_array) == bytes(want.byte_array)
        status = adapter.report_status()
        assert status["is_healthy"] and status["objects"][OBJECT_BYTES]["objects"] == 12
    finally:
        adapter.close()


def test_a_lookup_answers_the_stored_prefix(tmp_path):
    adapter = make_adapter(tmp_path)
    try:
        keys = make_object_keys(6)
        objects = buffers(6)
        store(adapter, keys[:2] + keys[3:], objects[:2] + objects[3:])
        assert lookup(adapter, keys) == [0, 1]  # stops at the hole
    finally:
        adapter.close()


def test_a_stale_weight_version_gets_no_hit(tmp_path, monkeypatch):
    monkeypatch.setattr(shelf_module, "VERSION_CHECK_S", 0.0)
    model = tmp_path / "model"
    model.mkdir()
    (model / "version.yaml").write_text("version: RL-STEP1-20261207-abc\n")
    adapter = make_adapter(tmp_path / "store", model_dir=str(model))
    try:
        keys = make_object_keys(4)
        store(adapter, keys, buffers(4))
        assert lookup(adapter, keys) == [0, 1, 2, 3]
        (model / "version.yaml").write_text("version: RL-STEP2-20261207-def\n")
        os.utime(model / "version.yaml", ns=(1, 1))  # another mtime, whatever the clock
        assert lookup(adapter, keys) == []
        assert load(adapter, keys, buffers(4)) == []
    finally:
        adapter.close()


def test_a_corrupt_object_is_a_miss_never_bytes(tmp_path):
    adapter = make_adapter(tmp_path)
    try:
        keys = make_object_keys(3)
        objects = buffers(3)
        randomize(objects, seed=2)
        store(adapter, keys, objects)
        shelf = adapter._shelf(OBJECT_BYTES)
        storage_key = adapter._storage_keys(shelf, keys[1:2])[0]
        raw = bytearray(shelf.backend.read_object(storage_key))
        raw[-100] ^= 0x01  # one payload bit
        shelf.backend.write_object(storage_key, bytes(raw))
        out = buffers(3, fill_offset=7)
        assert load(adapter, keys, out) == [0, 2]
        assert bytes(out[0].byte_array) == bytes(objects[0].byte_array)
        assert shelf.backend.stats.corrupt == 1
        assert lookup(adapter, keys) == [0]  # removed, so a hole now
    finally:
        adapter.close()


def test_two_ranks_never_share_a_key(tmp_path):
    adapter = make_adapter(tmp_path)
    try:
        chunk = (7).to_bytes(16, "big")
        rank0 = [ObjectKey(chunk_hash=chunk, model_name="m", kv_rank=0)]
        rank1 = [ObjectKey(chunk_hash=chunk, model_name="m", kv_rank=1)]
        a, b = buffers(1, fill_offset=1), buffers(1, fill_offset=2)
        store(adapter, rank0, a)
        assert lookup(adapter, rank1) == []
        store(adapter, rank1, b)
        out0, out1 = buffers(1, fill_offset=50), buffers(1, fill_offset=60)
        assert load(adapter, rank0, out0) == [0] and load(adapter, rank1, out1) == [0]
        assert bytes(out0[0].byte_array) == bytes(a[0].byte_array)
        assert bytes(out1[0].byte_array) == bytes(b[0].byte_array)
        salted = [ObjectKey(chunk_hash=chunk, model_name="m", kv_rank=0, cache_salt="u1")]
        assert lookup(adapter, salted) == []  # a salt is its own key space too
    finally:
        adapter.close()


def test_capacity_holds_and_lmcache_accounts_bytes_per_salt_through_evictions(tmp_path):
    capacity = 10 * (OBJECT_BYTES + 4096)
    adapter = make_adapter(
        tmp_path,
        storage={
            "backend": "file",
            "root": str(tmp_path),
            "capacity_bytes": capacity,
        },
    )
    try:
        salts = ("alice", "bob")
        for round_ in range(3):
            for s, salt in enumerate(salts):
                keys = [
                    ObjectKey(
                        chunk_hash=(1000 * round_ + 10 * s + i).to_bytes(16, "big"),
                        model_name="m",
                        kv_rank=0,
                        cache_salt=salt,
                    )
                    for i in range(4)
                ]
                assert store(adapter, keys, buffers(4)) >= 0
        shelf = adapter._shelf(OBJECT_BYTES)
        usage = shelf.backend.usage()
        assert usage.used_bytes <= capacity
        assert shelf.backend.stats.evictions > 0
        lookup(adapter, [])  # a task reports the evictions queued since the last
        reported = adapter.get_usage()
        assert reported.total_bytes_used == usage.num_objects * OBJECT_BYTES
        assert sum(reported.bytes_by_cache_salt.values()) == reported.total_bytes_used
        assert set(reported.bytes_by_cache_salt) <= set(salts)
    finally:
        adapter.close()


def test_bad_calls_and_settings_name_the_cause(tmp_path):
    adapter = make_adapter(tmp_path)
    try:
        with pytest.raises(ValueError, match="2 keys but 1 objects"):
            adapter.submit_store_task(make_object_keys(2), buffers(1))
    finally:
        adapter.close()
    with pytest.raises(ValueError, match="adapter_params.workers"):
        make_adapter(tmp_path, workers=0)
    with pytest.raises(ValueError, match="adapter_params.colour: unknown setting"):
        make_adapter(tmp_path, colour="blue")


def test_lmcache_bench_l2_drives_it_and_verifies_every_byte(tmp_path):
    """LMCache's own benchmark, as a user runs it: every key stored, found and loaded, and its
    round-trip check passes."""
    out = tmp_path / "result.json"
    cmd = [
        sys.executable, "-m", "lmcache.cli.main", "bench", "l2",
        "--l2-adapter", adapter_json(tmp_path / "store"),
        "--num-keys", "16", "--data-size-kb", "64", "--in-flight", "2", "--rounds", "2",
        "--lookup-max-hit-rate", "1.0", "--no-skip-verify",
        "--format", "json", "--output", str(out), "--quiet",
    ]  # fmt: skip
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    metrics = json.loads(out.read_text())["metrics"]
    ops = {m["operation"]: m for k, m in metrics.items() if k.startswith("op_")}
    assert ops["Store"]["total_success"] == ops["Store"]["total_keys"] == 64
    assert ops["Load"]["total_success"] == ops["Load"]["total_keys"] == 64
    assert ops["Lookup"]["total_success"] == 64


def test_a_large_load_with_a_bad_object_inside_answers_once_with_every_other_bit(tmp_path):
    """16 x 256 KiB (the store reads it over its own threads), the 12th object corrupt."""
    adapter = make_adapter(tmp_path)
    size = 256 * 1024
    try:
        keys = make_object_keys(16)
        objects = make_memory_objects(make_aligned_tensor(16 * size), 16, size, 0)
        randomize(objects, seed=5)
        assert store(adapter, keys, objects) == 16 * size
        shelf = adapter._shelf(size)
        bad = adapter._storage_keys(shelf, keys[11:12])[0]
        raw = bytearray(shelf.backend.read_object(bad))
        raw[-7] ^= 0x02
        shelf.backend.write_object(bad, bytes(raw))
        out = make_memory_objects(make_aligned_tensor(16 * size), 16, size, 0, 77)
        assert load(adapter, keys, out) == [i for i in range(16) if i != 11]
        for i in range(16):
            if i != 11:
                assert bytes(out[i].byte_array) == bytes(objects[i].byte_array)
        assert adapter.query_load_result(0) is None  # each task answered once, and popped
    finally:
        adapter.close()


def test_task_threads_run_every_task_once_hand_over_and_stop_cleanly():
    """The adapter's task threads: every task runs exactly once, on up to ``count`` threads at
    once (none waits for a busy one while another is idle); a thread that announced its answer
    gets the next task; a task that raises is logged and the thread goes on; ``shutdown``
    drops what has not begun and waits for what runs."""
    import logging
    import threading

    from kvtier.lmcache.parts import TaskThreads

    class Logged(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.ERROR)
            self.seen = threading.Event()

        def emit(self, record: logging.LogRecord) -> None:
            if "task failed" in record.getMessage() and record.exc_info:
                self.seen.set()

    logged = Logged()
    logging.getLogger("kvtier.lmcache").addHandler(logged)
    try:
        _drive_task_threads(TaskThreads(3, "t"), logged)
    finally:
        logging.getLogger("kvtier.lmcache").removeHandler(logged)


def _drive_task_threads(threads, logged) -> None:
    import threading

    ran: list[int] = []
    lock = threading.Lock()
    gate, started = threading.Event(), threading.Barrier(4)

    def blocked(i: int) -> None:
        started.wait(TASK_TIMEOUT_S)  # three at once, else the barrier breaks
        gate.wait(TASK_TIMEOUT_S)
        with lock:
            ran.append(i)

    for i in range(3):
        threads.submit(blocked, i)
    started.wait(TASK_TIMEOUT_S)
    for i in range(3, 6):  # queued while all three are busy
        threads.submit(lambda i=i: ran.append(i))
    gate.set()

    def boom() -> None:
        raise ValueError("a bug in a task")

    threads.submit(boom)
    names: list[str] = []
    done = threading.Event()

    def answer_then_more() -> None:
        names.append(threading.current_thread().name)
        threads.answering()
        threads.submit(lambda: (names.append(threading.current_thread().name), done.set()))

    threads.submit(answer_then_more)
    assert done.wait(TASK_TIMEOUT_S)
    assert names[0] == names[1]  # the thread that answered took the next task
    assert logged.seen.wait(TASK_TIMEOUT_S)  # logged, and the threads went on

    stuck = threading.Event()
    threads.submit(lambda: stuck.wait(TASK_TIMEOUT_S))
    threads.submit(lambda: stuck.wait(TASK_TIMEOUT_S))
    threads.submit(lambda: stuck.wait(TASK_TIMEOUT_S))
    threads.submit(lambda: ran.append(99))  # not begun at shutdown: dropped
    stopper = threading.Thread(target=threads.shutdown)
    stopper.start()
    stopper.join(0.2)
    assert stopper.is_alive()  # waits for the running tasks
    stuck.set()
    stopper.join(TASK_TIMEOUT_S)
    assert not stopper.is_alive()
    assert sorted(ran) == [0, 1, 2, 3, 4, 5]
    with pytest.raises(RuntimeError, match="stopped"):
        threads.submit(lambda: None)


def test_objects_in_lmcaches_l1_arena_and_outside_it_round_trip_byte_exact(tmp_path):
    """As LMCache's benchmark and controllers make it: the adapter sees the L1 arena
    (``l1_memory_desc``) and moves objects in it as slices of it; an object outside it (its
    own tensor) in the same tasks is moved from and into its own bytes."""
    from lmcache.cli.commands.bench.l2_adapter_bench.data import create_l1_memory_desc

    arena = make_aligned_tensor(8 * OBJECT_BYTES)
    settings = {"storage": {"backend": "file", "root": str(tmp_path)}}
    adapter = KvtierL2Adapter(settings, l1_memory_desc=create_l1_memory_desc(arena))
    try:
        keys = make_object_keys(4)
        inside = make_memory_objects(arena, 4, OBJECT_BYTES, 0)
        randomize(inside, seed=9)
        outside = buffers(1, fill_offset=3)
        objects = [inside[0], inside[1], outside[0], inside[3]]
        assert store(adapter, keys[:1], objects[:1]) == OBJECT_BYTES  # opens the shelf
        assert store(adapter, keys, objects) == 3 * OBJECT_BYTES
        targets = make_memory_objects(arena, 3, OBJECT_BYTES, 4 * OBJECT_BYTES) + buffers(1, 60)
        assert load(adapter, keys, targets) == [0, 1, 2, 3]
        for got, want in zip(targets, objects, strict=True):
            assert bytes(got.byte_array) == bytes(want.byte_array)
    finally:
        adapter.close()
