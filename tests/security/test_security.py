"""A hostile local neighbour: files planted by name, shadowing, a pre-created socket directory,
a second worker on one endpoint, junk in the store, and who can read stored KV.

Cross-user cases give files to another uid (65534) with chown, which needs root (CI runs as
root); elsewhere they skip with that reason.
"""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import stat
import uuid
from pathlib import Path

import numpy as np
import pytest

from conftest import SPECS
from kvtier.errors import ConfigError, DeviceCacheError, StorageError, UnsafeFile, WorkerError
from kvtier.layout.keys import KeyScheme, block_hashes
from kvtier.memory.device import DeviceCache
from kvtier.memory.host import HostPool
from kvtier.memory.shm import SHM_DIR
from kvtier.storage.file.store import FileStore
from kvtier.storage.mooncake.local import _log_file
from kvtier.transport.endpoint import EndpointClaim
from kvtier.worker.config import WorkerConfig, default_socket_dir

SPEC = SPECS["bf16"]
NOBODY = 65534


def _needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root (CI runs as root)")


@pytest.fixture
def planted(name):
    """Paths planted in /dev/shm under ``name``; removed afterwards."""
    paths: list[Path] = []
    yield name, paths
    for path in paths:
        path.unlink(missing_ok=True)


def test_a_planted_pickle_never_runs(planted, tmp_path) -> None:
    """A .cudaipc file used to be unpickled: a planted one ran code as the worker's user."""
    name, paths = planted
    marker = tmp_path / "owned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = SHM_DIR / f"{name}.cudaipc"
    paths.append(path)
    payload = pickle.dumps(Exploit())
    meta = json.dumps(
        {"spec": SPEC.to_dict(), "device": "cuda:0", "owner_pid": 1, "handles_bytes": len(payload)}
    ).encode()
    header = b"KVTIERDC" + (2).to_bytes(4, "little") + len(meta).to_bytes(4, "little") + meta
    path.write_bytes(header.ljust(4096, b"\0") + payload)
    os.chmod(path, 0o600)
    owner = os.open(path, os.O_RDONLY)  # a "live owner": the handle table itself is read
    fcntl.flock(owner, fcntl.LOCK_EX)
    try:
        with pytest.raises(DeviceCacheError, match="malformed"):
            DeviceCache.attach(SPEC, name)
    finally:
        os.close(owner)
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["kvcache", "cudaipc"])
def test_files_of_another_user_or_open_to_others_are_refused(planted, kind) -> None:
    name, paths = planted
    path = SHM_DIR / f"{name}.{kind}"
    paths.append(path)
    path.write_bytes(b"\0" * 8192)
    os.chmod(path, 0o644)
    with pytest.raises(UnsafeFile, match="mode 644"):
        DeviceCache.attach(SPEC, name)
    _needs_root()
    os.chmod(path, 0o600)
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(UnsafeFile, match="belongs to uid 65534"):
        DeviceCache.attach(SPEC, name)


def test_a_symlink_is_never_followed(planted, tmp_path) -> None:
    name, paths = planted
    target = tmp_path / "elsewhere"
    target.write_bytes(b"\0" * 8192)
    path = SHM_DIR / f"{name}.kvcache"
    paths.append(path)
    path.symlink_to(target)
    with pytest.raises(UnsafeFile, match="symbolic link"):
        DeviceCache.attach(SPEC, name)


def test_one_kind_never_shadows_another(planted) -> None:
    """A planted .kvcache beside a CUDA engine's .cudaipc would have been attached instead."""
    name, paths = planted
    with DeviceCache.create(SPEC, name):
        shadow = SHM_DIR / f"{name}.cudaipc"
        paths.append(shadow)
        shadow.write_bytes(b"\0" * 4096)
        os.chmod(shadow, 0o600)
        with pytest.raises(DeviceCacheError, match="refusing to guess"):
            DeviceCache.attach(SPEC, name)
        with DeviceCache.attach(SPEC, name, device_type="cpu") as cache:  # told: no guess
            assert cache.attached


def test_a_planted_file_at_our_name_is_not_taken_over(planted) -> None:
    _needs_root()
    name, paths = planted
    path = SHM_DIR / f"{name}.kvcache"
    paths.append(path)
    path.write_bytes(b"x")
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(UnsafeFile, match="not a file of this user"):
        DeviceCache.create(SPEC, name)
    assert path.exists()  # another user's file: never removed


def test_a_socket_directory_that_is_not_ours_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("TMPDIR", raising=False)
    mine = tmp_path / f"kvtier-{os.getuid()}"
    mine.mkdir(mode=0o755)
    with pytest.raises(ConfigError, match="not a private directory"):
        default_socket_dir()
    mine.rmdir()
    elsewhere = tmp_path / "trap"
    elsewhere.mkdir(mode=0o700)
    mine.symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="not a link"):
        default_socket_dir()
    mine.unlink()
    assert stat.S_IMODE(os.stat(default_socket_dir()).st_mode) == 0o700  # made private
    _needs_root()
    os.chown(mine, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match="owned by us"):
        default_socket_dir()


def test_a_second_worker_on_a_live_endpoint_is_refused(tmp_path) -> None:
    address = f"ipc://{default_socket_dir()}/sec{uuid.uuid4().hex[:8]}-rank0.sock"
    first = EndpointClaim(address).acquire()
    try:
        with pytest.raises(WorkerError, match="in use by a running worker"):
            EndpointClaim(address).acquire()
    finally:
        first.release()
    EndpointClaim(address).acquire().release()  # free again once the first is gone


def test_abstract_sockets_are_refused() -> None:
    with pytest.raises(ConfigError, match="abstract socket"):
        WorkerConfig(spec=SPEC, instance_id="x", endpoint="ipc://@kvtier")


# ---- the store --------------------------------------------------------------------------------


def _keys(n: int) -> list[str]:
    scheme = KeyScheme("sec", SPEC.fingerprint, 0)
    return scheme.keys(block_hashes(np.arange(n * SPEC.block_size) + 7, SPEC.block_size))


def test_stored_kv_is_private_by_default(tmp_path) -> None:
    root = tmp_path / "store"
    with FileStore(SPEC, {"root": root}) as store, HostPool(SPEC, 2) as pool:
        keys = _keys(1)
        assert store.put_from(keys, [pool.block(0)]) == [True]
        obj = store._path(keys[0])
    assert stat.S_IMODE(os.stat(obj).st_mode) == 0o600
    for directory in (root, root / "objects", obj.parent, root / "tmp"):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700, directory


def test_a_store_root_open_to_others_is_reported(tmp_path, caplog) -> None:
    root = tmp_path / "open"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    with FileStore(SPEC, {"root": root}):
        pass
    assert any("open to group/other" in r.getMessage() for r in caplog.records)


def test_junk_in_the_store_never_hangs_follows_or_lies(tmp_path) -> None:
    """A FIFO at an object path used to wedge loads forever; a symlinked fan-out directory sent
    writes and evictions outside the root; a directory at an object path made a key
    unloadable while saves reported it stored; a huge-pid temp name stopped every start."""
    root = tmp_path / "store"
    outside = tmp_path / "outside"
    outside.mkdir()
    keys = _keys(3)
    with FileStore(SPEC, {"root": root}) as store:
        fifo, directory = store._path(keys[0]), store._path(keys[1])
    os.mkfifo(fifo)
    directory.mkdir()
    fanout = store._path(keys[2]).parent
    for entry in fanout.iterdir():
        entry.unlink()
    fanout.rmdir()
    fanout.symlink_to(outside)
    (root / "tmp" / f"{10**30}-1-1.tmp").write_bytes(b"junk")
    with FileStore(SPEC, {"root": root}) as store, HostPool(SPEC, 4) as pool:  # starts fine
        assert not fanout.is_symlink() and fanout.is_dir()  # replaced, never followed
        assert store.exists_prefix(keys[:1]) == 0  # the FIFO is not an object...
        assert store.get_into(keys[:1], [pool.block(0)]) == [False]  # ...and never waited on
        assert store.put_from(keys[1:2], [pool.block(1)]) == [False]  # not "stored"
        assert store.put_from(keys[2:], [pool.block(2)]) == [True]
    assert list(outside.iterdir()) == []


# ---- authenticated objects --------------------------------------------------------------------


@pytest.mark.parametrize("authenticated", [False, True])
def test_a_writer_of_the_store_cannot_forge_what_a_worker_loads(tmp_path, authenticated) -> None:
    """Anyone who can write the store (another account of a shared store, any Mooncake client)
    can replace a payload and fix every checksum: the worker loaded it as ``ok``. With
    ``storage.mac_key_file`` it is a miss."""
    from kvtier.testing.contract import reseal
    from kvtier.transport import auth
    from kvtier.transport.tasks import Status
    from worker_helpers import WSPEC, block, engine, hashes

    root = tmp_path / "store"
    storage: dict = {"backend": "file", "root": str(root)}
    if authenticated:
        auth.write_key(tmp_path / "mac.key")
        storage["mac_key_file"] = str(tmp_path / "mac.key")
    with engine(tmp_path, world_size=1, storage=storage) as (client, caches):
        h = hashes(3)
        assert client.save(h, [1, 2, 3]).blocks == [1, 2, 3]
        objects = sorted((root / "objects").glob("*/*.kvb"))
        assert len(objects) == 3
        for path in objects:  # the forger: zeros instead of the prompt's KV, checksums fixed
            data = path.read_bytes()
            path.write_bytes(reseal(data, bytes(WSPEC.block_bytes)))
        loaded = client.load(h, [20, 21, 22])
        if authenticated:
            assert (loaded.status, loaded.blocks) == (Status.PARTIAL, [])  # looked stored: 0 ok
        else:  # what the attack does without a MAC: forged bytes delivered as data
            assert loaded.blocks == [20, 21, 22]
            assert not any(x.any() for x in block(caches[0], 20))


def test_the_mac_key_comes_from_a_private_file_or_the_environment(tmp_path, monkeypatch) -> None:
    from kvtier.storage import MAC_KEY_ENV, make_backend
    from kvtier.transport import auth

    key_file = tmp_path / "mac.key"
    key = auth.write_key(key_file)
    config = {"backend": "file", "root": str(tmp_path / "s"), "mac_key_file": str(key_file)}
    keys = _keys(1)
    with make_backend(SPEC, config) as store, HostPool(SPEC, 2) as pool:
        assert store.format.authenticated
        assert store.put_from(keys, [pool.block(0)]) == [True]
    monkeypatch.setenv(MAC_KEY_ENV, key.hex())
    del config["mac_key_file"]
    with make_backend(SPEC, config) as store, HostPool(SPEC, 2) as pool:
        assert store.get_into(keys, [pool.block(1)]) == [True]  # the same key, from the env
    monkeypatch.setenv(MAC_KEY_ENV, "not hex")
    with pytest.raises(ConfigError, match=MAC_KEY_ENV):
        make_backend(SPEC, config)
    monkeypatch.delenv(MAC_KEY_ENV)
    os.chmod(key_file, 0o644)
    with pytest.raises(ConfigError, match="storage.mac_key_file.*mode 0600"):
        make_backend(SPEC, {**config, "mac_key_file": str(key_file)})


# ---- endpoints ----------------------------------------------------------------------------------


def test_the_metrics_exporter_bounds_its_connections() -> None:
    """One thread per connection, unbounded and without a timeout, used to let any local user
    pile up threads in a worker with idle connections."""
    import socket
    import threading
    import time
    import urllib.request

    from kvtier.worker.metrics import CONNECTION_TIMEOUT_S, MAX_CONNECTIONS, WorkerMetrics

    snapshot = {"storage": {}, "queue_depths": {}, "state": "running"}
    metrics = WorkerMetrics(0, lambda: snapshot)
    port = metrics.serve(0)
    base = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
    try:
        time.sleep(0.5)
        assert threading.active_count() <= base + 2 * MAX_CONNECTIONS  # displaced ones end
        deadline = time.monotonic() + CONNECTION_TIMEOUT_S + 5
        while True:  # the idle ones time out; then a scrape is served again
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read()
                break
            except OSError:
                assert time.monotonic() < deadline, "the exporter never recovered"
                time.sleep(0.5)
        assert b"kvtier_worker_state" in text
    finally:
        for sock in idle:
            sock.close()
        metrics.close()


def test_trickling_peers_cannot_blind_the_metrics_exporter() -> None:
    """8 connections trickling a byte every few seconds held every slot (each byte reset the
    read timeout) and every scrape failed: now a request must arrive whole within a deadline."""
    import socket
    import threading
    import time
    import urllib.request

    from kvtier.worker.metrics import MAX_CONNECTIONS, REQUEST_DEADLINE_S, WorkerMetrics

    metrics = WorkerMetrics(0, lambda: {"storage": {}, "queue_depths": {}, "state": "running"})
    port = metrics.serve(0)
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port)) as s:
                    for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n":
                        if stop.wait(1.0):
                            return
                        s.send(bytes([byte]))
            except OSError:
                continue

    threads = [threading.Thread(target=trickle) for _ in range(MAX_CONNECTIONS)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # every slot is taken by a trickler now
        start, served = time.monotonic(), None
        while served is None and time.monotonic() - start < 4 * REQUEST_DEADLINE_S:
            try:
                served = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1)
            except OSError:
                time.sleep(0.2)
        assert served is not None, "no scrape got through while peers trickled"
        assert b"kvtier_worker_state" in served.read()
    finally:
        stop.set()
        for thread in threads:
            thread.join()
        metrics.close()


def test_a_client_cannot_queue_unbounded_work_and_heartbeats_keep_flowing(tmp_path) -> None:
    """100,000 queued tasks of 2^20 ids each used to be accepted by a paused worker: 4.1 GiB RSS
    and a 13 s heartbeat gap. Each client's queued ids are bounded; beyond, a clear refusal."""

    from kvtier.transport import tasks as t
    from kvtier.worker.gate import MAX_QUEUED_IDS_PER_OWNER
    from worker_helpers import engine

    ids = list(range(t.MAX_IDS_PER_TASK))
    per_task = 2 * len(ids)
    with engine(tmp_path, world_size=1, storage={"backend": "memory"}) as (client, _):
        assert client.control("pause").code == 200
        pid = client.pids[0]
        rss = _rss_kib(pid)
        futures = [
            client.submit(t.SwapOut(device_block_ids=ids, host_block_ids=ids)) for _ in range(60)
        ]
        held = MAX_QUEUED_IDS_PER_OWNER // per_task
        refused = [f.result(30) for f in futures[held:]]
        assert all(r.status is t.Status.ERROR for r in refused)
        assert "too much work queued" in refused[0].message
        pings = [client.ping(timeout_s=5) for _ in range(20)]
        assert max(pings) < 1.0
        assert _rss_kib(pid) - rss < 256 << 10  # KiB: well below what 60 such tasks would take
        assert client.control("resume").code == 200
        done = [f.result(60) for f in futures[:held]]  # answered: invalid ids, not dropped
        assert all(r.status is t.Status.ERROR for r in done)
        assert client.swap_out([1], [0]).status is t.Status.OK


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_a_mooncake_role_log_is_never_a_link_a_fifo_or_anothers_file(tmp_path) -> None:
    """A local master's or storage node's log (``log_path``) is appended to only if it is a
    regular file of this user: a link planted at its name (aimed at a file of ours), a FIFO
    (never waited on) and, as root, another account's file are refused; a fresh log is 0600."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"kept")
    (tmp_path / "link.log").symlink_to(victim)
    os.mkfifo(tmp_path / "fifo.log")
    for name in ("link.log", "fifo.log"):
        with pytest.raises(StorageError):
            _log_file(str(tmp_path / name))
    assert victim.read_bytes() == b"kept"
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs.log"
        theirs.write_bytes(b"")
        os.chown(theirs, NOBODY, NOBODY)
        with pytest.raises(StorageError):
            _log_file(str(theirs))
    with _log_file(str(tmp_path / "fresh.log")) as log:
        log.write(b"line\n")
    assert stat.S_IMODE((tmp_path / "fresh.log").stat().st_mode) == 0o600
