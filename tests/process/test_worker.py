"""Worker and client with real processes: every task moves real bytes; control; health."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import zmq

from kvtier.errors import TaskTimeout, WorkerLost
from kvtier.layout.keys import KeyScheme
from kvtier.storage.file.store import FileStore
from kvtier.transport import tasks as t
from kvtier.worker.config import default_socket_dir
from worker_helpers import (
    FAST,
    WSPEC,
    block,
    engine,
    fill,
    hashes,
    lone_worker_flags,
    same,
    scrape_a_busy_worker,
)

TESTS = Path(__file__).resolve().parents[1]  # the helpers live at the top of tests/


def test_every_task_type_moves_real_bytes(tmp_path) -> None:
    with engine(tmp_path) as (client, caches):
        want = {r: {b: block(c, b) for b in (1, 2, 3, 4)} for r, c in enumerate(caches)}
        assert client.swap_out([1, 2], [0, 1]).status is t.Status.OK
        res = client.swap_in([0, 1], [30, 31])
        assert (res.status, res.blocks) == (t.Status.OK, [30, 31])
        h = hashes(4)
        saved = client.save(h, [1, 2, 3, 4])
        assert (saved.status, saved.blocks) == (t.Status.OK, [1, 2, 3, 4])
        assert client.save(h, [1, 2, 3, 4]).bytes_moved == 0  # stored prefix skipped
        assert client.lookup(h) == 4
        loaded = client.load(h, [20, 21, 22, 23])
        assert (loaded.status, loaded.blocks) == (t.Status.OK, [20, 21, 22, 23])
        assert client.load_host(h[:2], [5, 6]).blocks == [5, 6]
        assert client.swap_in([5, 6], [35, 36]).status is t.Status.OK
        h2 = hashes(2, seed=9)
        assert client.save_host(h2, [5, 6]).blocks == [5, 6]
        assert client.load(h2, [37, 38]).blocks == [37, 38]
        for r, cache in enumerate(caches):
            assert same(block(cache, 30), want[r][1]) and same(block(cache, 31), want[r][2])
            for src, dst in zip((1, 2, 3, 4), (20, 21, 22, 23)):
                assert same(block(cache, dst), want[r][src])
            assert same(block(cache, 35), want[r][1]) and same(block(cache, 38), want[r][2])


def test_load_gives_the_shortest_prefix_over_ranks(tmp_path) -> None:
    root = tmp_path / "store"
    with engine(tmp_path, storage={"backend": "file", "root": str(root)}, namespace="m") as (
        client,
        caches,
    ):
        h = hashes(4)
        assert client.save(h, [1, 2, 3, 4]).status is t.Status.OK
        rank1 = KeyScheme("m", WSPEC.fingerprint, rank=1, version="")
        with FileStore(WSPEC, {"root": root}) as store:
            assert store.delete([rank1.key(h[2])]) == 1  # rank 1 lacks block 2
        assert client.lookup(h) == 2
        res = client.load(h, [20, 21, 22, 23])
        assert res.status is t.Status.PARTIAL and res.blocks == [20, 21]
        assert "loaded 2 of 4" in res.message


def test_pause_holds_tasks_and_resume_releases_them_in_order(tmp_path) -> None:
    with engine(tmp_path) as (client, caches):
        assert client.control("pause").code == 200
        assert client.control("pause").message.count("already paused") == 2  # idempotent
        order = []
        futures = []
        for i in range(10):
            f = client.submit(t.SwapOut(device_block_ids=[i], host_block_ids=[i]))
            f.add_done_callback(lambda _, i=i: order.append(i))
            futures.append(f)
        time.sleep(0.5)
        assert not any(f.done() for f in futures)  # held, not dropped, not run
        answer = client.control("resume")
        assert answer.code == 200 and "released 10 held tasks" in answer.message
        results = [f.result(10) for f in futures]
        assert all(r.status is t.Status.OK for r in results)
        assert order == list(range(10))  # in order
        assert client.control("resume").message.count("already running") == 2


def test_sleep_and_wakeup_keep_host_and_storage_data(tmp_path) -> None:
    with engine(tmp_path) as (client, caches):
        want = [block(c, 3) for c in caches]
        client.swap_out([3], [7])
        h = hashes(1)
        client.save(h, [3])
        assert client.control("sleep").code == 200
        assert "already sleeping" in client.control("sleep").message
        res = client.swap_in([7], [9])
        assert res.status is t.Status.ERROR and "sleeping" in res.message
        assert client.control("resume").code == 409
        assert client.control("wakeup").code == 200
        assert "already awake" in client.control("wakeup").message
        assert client.swap_in([7], [9]).status is t.Status.OK
        assert client.load(h, [10]).blocks == [10]
        for cache, w in zip(caches, want):
            assert same(block(cache, 9), w) and same(block(cache, 10), w)


def test_update_weights_makes_old_keys_unreachable(tmp_path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "version.yaml").write_text("version: RL-STEP1-20250101-abc\n")
    with engine(tmp_path, model_dir=str(tmp_path / "model")) as (client, caches):
        h = hashes(3)
        client.save(h, [1, 2, 3])
        assert client.lookup(h) == 3
        answer = client.control("update_weights", version="RL-STEP2")
        assert answer.code == 200 and "RL-STEP2" in answer.message
        assert client.lookup(h) == 0
        assert client.load(h, [5, 6, 7]).blocks == []
        (tmp_path / "model" / "version.yaml").write_text("version: RL-STEP1-20250102-def\n")
        assert client.control("update_weights").code == 200  # re-read version.yaml
        assert client.lookup(h) == 3
        bad = client.control("update_weights", version=5)
        assert bad.code == 400


def test_control_errors(tmp_path) -> None:
    with engine(tmp_path, world_size=1) as (client, caches):
        answer = client.control("reboot")
        assert answer.code == 400 and "unknown control method 'reboot'" in answer.message
        assert client.control("pause", bogus=1).code == 400
        stats = client.control("stats").per_rank[0].data
        assert stats["state"] == "running" and "queue_depths" in stats
        for bad, why in (
            ({"step_s": -1.0}, "step_s must be seconds >= 0"),
            ({"step_s": "fast"}, "step_s must be seconds >= 0"),
            ({"Bad-Name": 1.0}, "bad name"),
            ({f"n{i}": 1.0 for i in range(40)}, "at most 32 names"),
        ):
            answer = client.control("estimates", **bad)
            assert answer.code == 400 and why in answer.message, answer.message
        assert client.control("estimates", step_s=0.05).code == 200
        assert client.control("stats").per_rank[0].data["estimates"] == {"step_s": 0.05}


def test_bad_input_gets_a_clear_error_and_the_worker_goes_on(tmp_path) -> None:
    with engine(tmp_path, world_size=1) as (client, caches):
        cases = [
            (
                t.SwapOut(device_block_ids=[1, 2], host_block_ids=[3]),
                "2 entries but host_block_ids has 1",
            ),
            (
                t.SwapOut(device_block_ids=[400], host_block_ids=[0]),
                "device block id 400 out of range 0..39",
            ),
            (
                t.SwapIn(host_block_ids=[16], device_block_ids=[0]),
                "host block id 16 out of range 0..15",
            ),
            (
                t.SwapIn(host_block_ids=[0, 1], device_block_ids=[5, 5]),
                "device block id 5 appears twice",
            ),
            (t.Save(block_hashes=[b"short"], device_block_ids=[1]), "block hash 0 has 5 bytes"),
            (
                t.Load(block_hashes=hashes(2), device_block_ids=[1]),
                "block_hashes has 2 entries but device_block_ids has 1",
            ),
        ]
        for task, message in cases:
            res = client.submit(task).result(10)
            assert res.status is t.Status.ERROR and message in res.message, res
        assert client.swap_out([1], [0]).status is t.Status.OK


def test_garbage_on_the_socket_is_logged_and_dropped(tmp_path) -> None:
    with engine(tmp_path, world_size=1) as (client, caches):
        endpoint = client._ranks[0].endpoint
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.connect(endpoint)
        import msgspec

        for junk in (b"", b"\x00\xff garbage", b"\x93\x01\x02", os.urandom(5000)):
            raw.send(junk)
        raw.send(
            msgspec.msgpack.encode({"type": "swap_out", "task_id": 77, "device_block_ids": "nope"})
        )
        assert raw.poll(5000), "a malformed task with a task id is answered"
        (answer,) = t.decode_frame(raw.recv())
        assert answer.task_id == 77 and answer.status is t.Status.ERROR
        assert "malformed task" in answer.message
        raw.send(t.encode(t.Hello(protocol_version=99, client_id="old")))
        assert raw.poll(5000)
        (welcome,) = t.decode_frame(raw.recv())
        assert not welcome.accepted and "protocol version 99 is not supported" in welcome.message
        raw.close(0)
        ctx.term()
        assert client.swap_out([1], [0]).status is t.Status.OK
    log = (tmp_path / "rank0.log").read_text()
    assert "not a kvtier message" in log


def test_worker_killed_mid_task_fails_pending_futures_quickly(tmp_path) -> None:
    with engine(tmp_path, storage={"backend": "memory", "faults": {"latency_s": 2.0}}) as (
        client,
        caches,
    ):
        future = client.submit(t.Save(block_hashes=hashes(2), device_block_ids=[1, 2]))
        time.sleep(0.3)
        start = time.monotonic()
        os.kill(client.pids[1], signal.SIGKILL)
        with pytest.raises(WorkerLost, match="rank 1: worker process exited"):
            future.result(10)
        assert time.monotonic() - start < FAST["worker_timeout_s"]
        with pytest.raises(WorkerLost):  # later tasks fail at once, never hang
            client.swap_out([1], [0])


def test_task_timeout(tmp_path) -> None:
    with (
        engine(
            tmp_path, world_size=1, storage={"backend": "memory", "faults": {"latency_s": 3.0}}
        ) as (client, _),
        pytest.raises(TaskTimeout, match="ranks \\[0\\] did not answer in time"),
    ):
        client.submit(t.Lookup(block_hashes=hashes(1)), timeout_s=0.5).result(10)


def test_engine_death_makes_workers_exit(tmp_path) -> None:
    script = TESTS / "engine_process.py"
    instance = f"eng{uuid.uuid4().hex[:8]}"
    engine_proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), "2", instance],
        stdout=subprocess.PIPE,
        text=True,
        cwd=TESTS,
    )
    try:
        pids = [int(p) for p in engine_proc.stdout.readline().split()]
        assert len(pids) == 2
        engine_proc.kill()
        engine_proc.wait(10)
        start = time.monotonic()
        while any(_alive(p) for p in pids) and time.monotonic() - start < 15:
            time.sleep(0.1)
        took = time.monotonic() - start
        assert not any(_alive(p) for p in pids), "workers outlived their engine"
        assert took < 2.0 + 3.0  # well within engine_timeout_s=2 plus shutdown
        logs = "".join(p.read_text() for p in tmp_path.glob("rank*.log"))
        # Workers watch the process that launched them: gone, they exit at once.
        assert logs.count("that launched this worker is gone") == 2
        assert len(list(Path("/dev/shm").glob(f"kvtier-{instance}-*"))) == 0
        assert len(list(default_socket_dir().glob(f"{instance}-*"))) == 0
    finally:
        engine_proc.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its dead parent) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_concurrent_submitters(tmp_path) -> None:
    with engine(tmp_path) as (client, caches):
        errors, answered = [], []

        def run(offset: int) -> None:
            try:
                for i in range(50):
                    res = client.swap_out([offset + i % 10], [offset // 10 + i % 5])
                    answered.append(res.status)
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(o,)) for o in (0, 10)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors and len(answered) == 100
        assert all(s is t.Status.OK for s in answered)
        fill(caches[0], 5)


def test_in_process_worker_as_a_library_object(tmp_path) -> None:
    from kvtier.engine.client import Client
    from kvtier.worker.config import WorkerConfig
    from kvtier.worker.loop import Worker

    cfg = WorkerConfig(
        spec=WSPEC,
        instance_id=f"lib{uuid.uuid4().hex[:6]}",
        device_cache_mode="create",
        storage={"backend": "memory"},
        num_host_blocks=8,
        staging_blocks=2,
    )
    worker = Worker(cfg).start()
    try:
        fill(worker.resources.device_cache, 3)
        want = block(worker.resources.device_cache, 5)
        with Client.connect([cfg.endpoint_address], **FAST) as client:
            assert client.save(hashes(1), [5]).status is t.Status.OK
            assert client.load(hashes(1), [6]).blocks == [6]
            assert client.ping() < 1.0
            assert same(block(worker.resources.device_cache, 6), want)
        # A client that only connected leaves the worker running; this one can connect again.
        with Client.connect([cfg.endpoint_address], **FAST) as client:
            assert client.lookup(hashes(1)) == 1
            client.close(shutdown_workers=True)
        worker._thread.join(10)
        assert not worker._thread.is_alive()
    finally:
        worker.close()
    assert not Path(cfg.endpoint_address[len("ipc://") :]).exists()
    assert not list(Path("/dev/shm").glob(f"kvtier-{cfg.instance_id}-*"))


def test_sigterm_answers_every_task_and_cleans_up(tmp_path) -> None:
    with engine(
        tmp_path, world_size=1, storage={"backend": "memory", "faults": {"latency_s": 0.5}}
    ) as (client, _):
        futures = [client.submit(t.Lookup(block_hashes=hashes(1))) for _ in range(4)]
        time.sleep(0.2)  # the first is running, three are queued behind it
        os.kill(client.pids[0], signal.SIGTERM)
        statuses = []
        for f in futures:
            try:
                statuses.append(f.result(10).status)
            except WorkerLost:
                statuses.append("lost")
        assert statuses[0] is t.Status.OK  # in flight: finished
        assert all(s is t.Status.CANCELLED for s in statuses[1:]), statuses  # queued: answered
        assert client._ranks[0].process.wait(10) == 0


def test_wakeup_without_the_device_cache_is_a_500_then_recovers(tmp_path) -> None:
    from kvtier.memory.device import DeviceCache

    with engine(tmp_path, world_size=1) as (client, caches):
        name = caches[0].name
        assert client.control("sleep").code == 200
        caches[0].close()  # the engine freed its cache (say, for training)
        answer = client.control("wakeup")
        assert answer.code == 500 and "cannot re-attach the device cache" in answer.message
        caches[0] = DeviceCache.create(WSPEC, name)  # re-created, as after training
        assert client.control("wakeup").code == 200
        assert client.swap_out([1], [0]).status is t.Status.OK


def test_resume_rereads_version_yaml_and_a_missing_file_keeps_it(tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "version.yaml").write_text("version: RL-STEP5-20250101-abc\n")
    with engine(tmp_path, world_size=1, model_dir=str(model)) as (client, _):
        h = hashes(2)
        client.save(h, [1, 2])
        (model / "version.yaml").write_text("version: RL-STEP6-20250102-abc\n")
        client.control("pause")
        assert "RL-STEP6" in client.control("resume").message
        assert client.lookup(h) == 0
        (model / "version.yaml").unlink()
        answer = client.control("update_weights")
        assert answer.code == 200 and "stays 'RL-STEP6'" in answer.message
        client.save(h, [1, 2])
        assert client.lookup(h) == 2


def test_launch_failure_says_why(tmp_path) -> None:
    from kvtier.engine.client import Client
    from kvtier.errors import WorkerError

    with pytest.raises(WorkerError, match="no device cache named"):
        Client.launch(WSPEC, 1, {"backend": "memory"}, start_timeout_s=30)


def test_serve_with_the_old_engine_flags(tmp_path) -> None:
    from kvtier.engine.client import Client
    from kvtier.worker.config import endpoint_for

    instance = f"old{uuid.uuid4().hex[:6]}"
    flags = [
        "--instance-id",
        instance,
        "--key_cache_shape",
        "40,2,16,64",
        "--value_cache_shape",
        "40,2,16,64",
        "--cache_dtype",
        "block_wise_fp8",
        "--num_layers",
        "2",
        "--rank",
        "0",
        "--mp_num",
        "1",
        "--num_cpu_blocks",
        "16",
        "--storage_backend",
        "file",
        "--storage-root",
        str(tmp_path / "s"),
        "--write_policy",
        "write_through",
        "--max_model_len",
        "256",
        "--model_path",
        str(tmp_path),
        "--device-cache-mode",
        "create",
        "--engine-timeout-s",
        "20",
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.ops.cli", "serve", *flags], stderr=subprocess.PIPE, text=True
    )
    try:
        with Client.connect([endpoint_for(instance, 0)], **FAST) as client:
            assert client.save(hashes(2), [1, 2]).blocks == [1, 2]
            stats = client.control("stats").per_rank[0].data
            assert stats["tasks"]["save"]["tasks"] == 1
            client.close(shutdown_workers=True)
        assert proc.wait(20) == 0
        err = proc.stderr.read()
        assert "rank0 INFO" in err and "save 1 -> ok, 2 blocks" in err  # rank in every line
    finally:
        proc.kill()


def test_prometheus_metrics_are_scraped_over_loopback(tmp_path) -> None:
    text = scrape_a_busy_worker(tmp_path)
    want = [
        'kvtier_tasks_total{kind="swap_out",rank="0",status="ok"} 1.0',
        'kvtier_tasks_total{kind="swap_out",rank="0",status="error"} 1.0',
        'kvtier_tasks_total{kind="load",rank="0",status="ok"} 1.0',
        'kvtier_task_bytes_count{kind="save",rank="0"} 1.0',
        'kvtier_task_seconds_bucket{kind="swap_out",le="0.5",rank="0"} 2.0',
        'kvtier_errors_total{kind="InvalidBlockIds",rank="0"} 1.0',
        'kvtier_storage_blocks_total{rank="0",result="hit"} 2.0',
        'kvtier_storage_puts_total{rank="0",result="ok"} 2.0',
        'kvtier_queue_depth{direction="save",rank="0"} 0.0',
        'kvtier_worker_state{rank="0",state="running"} 1.0',
        'kvtier_estimate_seconds{rank="0",tier="",what="prefill_s_per_token"} 0.0001',
        'kvtier_estimate_seconds{rank="0",tier="0",what="load_s_per_block"} 0.002',
    ]
    for line in want:
        assert line in text, line


def test_a_worker_nobody_talks_to_exits_after_engine_timeout(tmp_path) -> None:
    """A worker run on its own (no launcher to watch) exits after engine_timeout_s of silence
    from every client that said hello; a peer that never said hello keeps nothing alive."""
    from kvtier.engine.client import Client
    from kvtier.worker.config import endpoint_for

    instance = f"idle{uuid.uuid4().hex[:6]}"
    flags = lone_worker_flags(instance)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvtier.ops.cli", "serve", *flags, "--engine-timeout-s", "2"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        endpoint = endpoint_for(instance, 0)
        client = Client.connect([endpoint], **FAST)
        assert client.swap_out([1], [0]).status is t.Status.OK
        client.close()  # connected, not launched: the worker keeps running, unheard from
        ctx = zmq.Context()
        stranger = ctx.socket(zmq.DEALER)
        stranger.connect(endpoint)
        start = time.monotonic()
        while proc.poll() is None and time.monotonic() - start < 20:
            stranger.send(t.encode(t.Heartbeat(sent_at=time.time())))  # no hello: ignored
            time.sleep(0.2)
        stranger.close(0)
        ctx.term()
        assert proc.wait(5) == 3
        assert 2.0 <= time.monotonic() - start < 10
        assert "nothing from the engine" in proc.stderr.read()
    finally:
        proc.kill()


def test_the_engines_silence_counts_from_its_first_hello(tmp_path) -> None:
    """Item: at load 13 a worker with engine_timeout_s=2 exited before the engine's first hello.
    Before an engine says hello, only start_timeout_s bounds the wait; from the hello on, the
    engine's silence (engine_timeout_s)."""
    from kvtier.engine.client import Client
    from kvtier.worker.config import endpoint_for

    def serve(instance: str, start_timeout_s: float) -> subprocess.Popen:
        flags = [*lone_worker_flags(instance), "--engine-timeout-s", "1"]
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvtier.ops.cli",
                "serve",
                *flags,
                "--start-timeout-s",
                f"{start_timeout_s}",
            ],
            stderr=subprocess.PIPE,
            text=True,
        )

    waiting, ungreeted = f"wait{uuid.uuid4().hex[:6]}", f"lone{uuid.uuid4().hex[:6]}"
    patient = serve(waiting, 120)
    socket = Path(endpoint_for(waiting, 0)[len("ipc://") :])
    deadline = time.monotonic() + 120
    while not socket.exists() and patient.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # the patient worker serves from now on
    brief = serve(ungreeted, 4)
    try:
        assert brief.wait(60) == 3  # nobody said hello within its start timeout
        assert "no engine said hello" in brief.stderr.read()
        # The patient worker has served longer than its engine_timeout_s (1 s), unheard from:
        assert patient.poll() is None
        client = Client.connect([endpoint_for(waiting, 0)], **FAST)
        assert client.swap_out([1], [0]).status is t.Status.OK
        client.close()
        assert patient.wait(30) == 3  # now 1 s of the engine's silence ends it
    finally:
        for proc in (patient, brief):
            proc.kill()
            proc.wait()


def test_cpu_cores_place_every_thread_of_the_worker(tmp_path, monkeypatch) -> None:
    """``cpu_cores`` moves the worker and every thread it starts there, and an engine's
    OpenMP binding (vLLM's ``OMP_PLACES``) is not inherited: it would pull kvtier's threads
    back onto the engine's compute cores."""
    core = max(os.sched_getaffinity(0))
    monkeypatch.setenv("OMP_PLACES", "{0}")
    monkeypatch.setenv("OMP_PROC_BIND", "true")
    with engine(tmp_path, world_size=1, cpu_cores=str(core)) as (client, _):
        assert client.save(hashes(2), [1, 2]).status is t.Status.OK  # its threads exist now
        (pid,) = client.pids
        threads = list(Path(f"/proc/{pid}/task").iterdir())
        assert len(threads) > 1
        for thread in threads:
            assert os.sched_getaffinity(int(thread.name)) == {core}
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert not [v for v in environ if v.startswith((b"OMP_PLACES=", b"OMP_PROC_BIND="))]


def test_a_bad_cpu_list_names_the_field() -> None:
    from kvtier.errors import ConfigError
    from kvtier.worker.config import WorkerConfig

    for bad in ("", "a", "3-1", "1,,x"):
        with pytest.raises(ConfigError, match="cpu_cores"):
            WorkerConfig(spec=WSPEC, instance_id="x", cpu_cores=bad)
