"""The file backend: the contract, crash safety, capacity, recovery, layout on disk."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from crash_saver import run_iterations
from kvtier.errors import ConfigError
from kvtier.memory.host import HostPool
from kvtier.storage import make_backend
from kvtier.storage.file import io as file_io
from kvtier.storage.file.config import FileStoreConfig, FsyncPolicy
from kvtier.storage.file.store import FileStore
from kvtier.testing.contract import CONTRACT_SPEC, StoreContract, expected_block, make_keys

TESTS = Path(__file__).resolve().parents[1]  # the helpers live at the top of tests/


class TestFileStore(StoreContract):
    persistent = True
    multi_process = True

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path):
        self.root = tmp_path / "store"

    def store_config(self) -> dict:
        return {"backend": "file", "root": str(self.root)}

    def make_store(self, spec):
        return make_backend(spec, self.store_config())


class TestFileStoreInPython(TestFileStore):
    """The same contract with the store's Python reads and writes (no ``kvtier._fileio``)."""

    @pytest.fixture(autouse=True)
    def _python_io(self, monkeypatch):
        monkeypatch.setattr(file_io, "_fileio", None)


def test_a_private_store_keeps_its_directories_open_and_a_group_store_does_not(tmp_path) -> None:
    with FileStore(CONTRACT_SPEC, {"root": tmp_path / "private"}) as private:
        assert private._dirs.keeps_descriptors
    with FileStore(CONTRACT_SPEC, {"root": tmp_path / "g", "permissions": "group"}) as group:
        assert not group._dirs.keeps_descriptors  # others may swap them: walked every time


def test_a_store_deleted_and_made_again_by_another_process_is_seen(tmp_path) -> None:
    """A store that keeps its fan-out descriptors must not keep reading deleted directories."""
    root = tmp_path / "store"
    keys = make_keys(3)
    with HostPool(CONTRACT_SPEC, 3) as pool, FileStore(CONTRACT_SPEC, {"root": root}) as store:
        nbytes = CONTRACT_SPEC.block_bytes
        for i in range(3):
            pool.block(i).copy_(expected_block(keys[i], nbytes))
        assert store.put_from(keys[:1], [pool.block(0)]) == [True]
        subprocess.run(["rm", "-rf", str(root)], check=True)
        with FileStore(CONTRACT_SPEC, {"root": root}) as other:  # made again, written to
            assert other.put_from(keys[1:2], [pool.block(1)]) == [True]
        pool.block(2).zero_()
        assert store.get_into(keys[1:2], [pool.block(2)]) == [True]
        assert torch.equal(pool.block(2), expected_block(keys[1], nbytes))
        assert store.exists_prefix(keys[:1]) == 0  # the deleted one is gone for both
        assert store.put_from(keys[2:], [pool.block(0)]) == [True]
        with FileStore(CONTRACT_SPEC, {"root": root}) as other:
            assert other.exists_prefix(keys[2:]) == 1  # written into the new directories


@pytest.mark.parametrize("fsync", ["data", "full"])
def test_fsync_policies_round_trip(tmp_path, fsync: str) -> None:
    store = FileStore(CONTRACT_SPEC, {"root": tmp_path, "fsync": fsync})
    assert store.config.fsync is FsyncPolicy(fsync)
    keys = make_keys(3)
    with HostPool(CONTRACT_SPEC, 6) as pool, store:
        for i, k in enumerate(keys):
            pool.block(i).copy_(expected_block(k, pool.block_bytes))
        assert store.put_from(keys, [pool.block(i) for i in range(3)]) == [True] * 3
        assert store.get_into(keys, [pool.block(3 + i) for i in range(3)]) == [True] * 3
        assert torch.equal(pool.slab[:3], pool.slab[3:])


def test_on_disk_layout(tmp_path) -> None:
    keys = make_keys(2)
    with HostPool(CONTRACT_SPEC, 2) as pool, FileStore(CONTRACT_SPEC, {"root": tmp_path}) as s:
        s.put_from(keys, [pool.block(0), pool.block(1)])
    files = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.kvb"))
    assert len(files) == 2
    for f in files:
        assert f.parts[0] == "objects" and len(f.parts[1]) == 2 and f.name.startswith(f.parts[1])
        data = (tmp_path / f).read_bytes()
        key = data[64 + CONTRACT_SPEC.block_bytes :].decode()  # the key trailer
        assert key in keys and hashlib.sha256(key.encode()).hexdigest() + ".kvb" == f.name
    assert list(tmp_path.rglob("*.tmp")) == []  # no write left in progress


def test_capacity_evicts_lru_and_survives_restart(tmp_path) -> None:
    keys = make_keys(6)
    object_bytes = 64 + CONTRACT_SPEC.block_bytes + len(keys[0])  # header, block, key trailer
    config = {"root": tmp_path, "capacity_bytes": 4 * object_bytes}
    with HostPool(CONTRACT_SPEC, 6) as pool:
        blocks = [pool.block(i) for i in range(6)]
        with FileStore(CONTRACT_SPEC, config) as store:
            store.put_from(keys[:4], blocks[:4])
            now = time.time()
            for age, key in zip((400, 300, 200, 100), keys[:4]):  # a known, old mtime order
                path = store._path(key)
                os.utime(path, (now - age, now - age))
            store.get_into(keys[:1], blocks[5:6])  # key 0 becomes the most recent
        with FileStore(CONTRACT_SPEC, config) as store:  # index rebuilt from the directory
            assert store.usage().num_objects == 4
            assert store.usage().used_bytes == 4 * object_bytes
            store.put_from(keys[4:6], blocks[4:6])
            present = [store.exists_prefix([k]) for k in keys]
            assert present == [1, 0, 0, 1, 1, 1]  # keys 1 and 2 were least recently used
            assert store.stats.evictions == 2
            assert store.usage().used_bytes <= 4 * object_bytes


def test_store_directory_removed_then_recovers(tmp_path) -> None:
    root = tmp_path / "store"
    keys = make_keys(2)
    with HostPool(CONTRACT_SPEC, 2) as pool, FileStore(CONTRACT_SPEC, {"root": root}) as store:
        assert store.put_from(keys[:1], [pool.block(0)]) == [True]
        subprocess.run(["rm", "-rf", str(root)], check=True)
        assert store.exists_prefix(keys) == 0
        assert store.get_into(keys[:1], [pool.block(1)]) == [False]
        assert store.put_from(keys[1:], [pool.block(1)]) == [True]  # recreated by itself
        assert store.exists_prefix(keys[1:]) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_fails_puts_cleanly(tmp_path) -> None:
    keys = make_keys(1)
    with HostPool(CONTRACT_SPEC, 1) as pool, FileStore(CONTRACT_SPEC, {"root": tmp_path}) as s:
        fanout = s._path(keys[0]).parent  # writes in progress live beside their objects
        os.chmod(fanout, 0o500)
        try:
            assert s.put_from(keys, [pool.block(0)]) == [False]
        finally:
            os.chmod(fanout, 0o700)


def test_tmp_files_of_dead_writers_are_removed(tmp_path) -> None:
    FileStore(CONTRACT_SPEC, {"root": tmp_path}).close()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    fanout = tmp_path / "objects" / "a7"
    for directory in (tmp_path / "tmp", fanout):  # beside the objects, and the former tmp/
        (directory / f"{dead}-1-0.tmp").write_bytes(b"partial")
        (directory / f"{os.getpid()}-1-0.tmp").write_bytes(b"in progress")  # a live writer
    FileStore(CONTRACT_SPEC, {"root": tmp_path}).close()
    assert os.listdir(tmp_path / "tmp") == [f"{os.getpid()}-1-0.tmp"]
    assert os.listdir(fanout) == [f"{os.getpid()}-1-0.tmp"]


def test_config_errors_name_the_field(tmp_path) -> None:
    with pytest.raises(ConfigError, match="storage.fsync: got 'always'; allowed: none, data"):
        FileStoreConfig.from_dict({"root": tmp_path, "fsync": "always"})
    with pytest.raises(ConfigError, match="storage.capacity_bytes"):
        FileStoreConfig.from_dict({"capacity_bytes": -5})
    with pytest.raises(ConfigError, match="storage.io_threads"):
        FileStoreConfig.from_dict({"io_threads": 0})
    with pytest.raises(ConfigError, match="storage.rooot: unknown option"):
        FileStoreConfig.from_dict({"rooot": "/x"})
    allowed = "allowed: file, mooncake, memory, s3"
    with pytest.raises(ConfigError, match=f"storage.backend: got 'redis'; {allowed}"):
        make_backend(CONTRACT_SPEC, {"backend": "redis"})


def test_default_root_is_under_the_user_cache(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert FileStoreConfig.from_dict({}).root == tmp_path / "kvtier" / "store"


def test_sigkill_during_large_saves_never_leaves_a_visible_partial_object(tmp_path) -> None:
    rows = run_iterations(tmp_path, 24, seed=1, timeout_s=300)
    for row in rows:
        assert row["visible"] == row["whole"], row  # every visible object is whole and right
        assert row["prefix_ok"], row
        assert row["tmp_left"] == 0, row  # the next start removed the dead writer's temp files
    assert all(r["killed"] for r in rows)  # every kill landed mid-save
    assert any(r["partial_batch"] for r in rows)  # and some in the middle of a batch


def test_the_default_store_has_a_capacity(monkeypatch, tmp_path) -> None:
    """The store nobody configured (vLLM's connector without `storage`) had no size limit."""
    from kvtier.storage.file.config import DEFAULT_STORE_CAPACITY_BYTES, FileStoreConfig

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    default = FileStoreConfig.from_dict({})
    assert default.root == tmp_path / "kvtier" / "store"
    assert default.capacity_bytes == DEFAULT_STORE_CAPACITY_BYTES == 32 << 30
    assert FileStoreConfig.from_dict({"capacity_bytes": 1 << 20}).capacity_bytes == 1 << 20
    assert FileStoreConfig.from_dict({"root": str(tmp_path / "s")}).capacity_bytes is None


def test_large_saves_are_written_in_parallel_at_the_callers_priority(tmp_path) -> None:
    """A large batch is written by the store's I/O threads (one thread reached half the rate
    of a raw write with as many threads), and they run at the priority of the thread that
    saves: a worker's background save thread stays background work."""
    import threading

    n = max(8, (8 << 20) // CONTRACT_SPEC.block_bytes)  # above the parallel threshold
    keys = make_keys(n)
    seen: dict = {}
    with HostPool(CONTRACT_SPEC, n) as pool, FileStore(CONTRACT_SPEC, {"root": tmp_path}) as s:
        blocks = [pool.block(i) for i in range(n)]

        def background_save() -> None:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            seen["ok"] = s.put_from(keys, blocks)

        saver = threading.Thread(target=background_save)
        saver.start()
        saver.join()
        assert seen["ok"] == [True] * n
        writers = list(s._writers.get()._threads)
        assert len(writers) > 1
        assert {os.getpriority(os.PRIO_PROCESS, t.native_id) for t in writers} == {10}
        assert s.get_into(keys, blocks) == [True] * n
