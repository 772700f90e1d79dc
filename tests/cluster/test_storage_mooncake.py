"""The mooncake backend against a real mooncake_master: the contract, outages, config."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import require_mooncake
from kvtier.common.config_sources import Source, merge
from kvtier.errors import ConfigError, StorageUnavailable
from kvtier.memory.host import HostPool
from kvtier.testing.contract import CONTRACT_SPEC, StoreContract, expected_block, make_keys
from kvtier.worker.config import env_sources


@pytest.fixture(autouse=True, scope="module")
def _mooncake_present():
    require_mooncake()


from kvtier.storage import make_backend  # noqa: E402
from kvtier.storage.mooncake.local import LocalMaster  # noqa: E402
from kvtier.storage.mooncake.store import MooncakeConfig, MooncakeStore  # noqa: E402

SMALL = {"global_segment_size": 128 << 20, "local_buffer_size": 32 << 20}


@pytest.fixture(scope="module")
def master():
    with LocalMaster() as m:
        yield m


class TestMooncakeStore(StoreContract):
    multi_process = True
    header_checked_on_exists = False  # batch_is_exist asks the master; loads check every byte

    @pytest.fixture(autouse=True)
    def _master(self, master):
        self.master = master

    def store_config(self) -> dict:
        return self.master.config(**SMALL)

    def make_store(self, spec):
        return make_backend(spec, self.store_config())

    # One client and one pool for the class: a Mooncake client takes ~2 s to close.
    @pytest.fixture(scope="class")
    def pool(self):
        with HostPool(CONTRACT_SPEC, 16) as pool:
            yield pool

    @pytest.fixture(scope="class")
    def store(self, pool, master):
        store = make_backend(CONTRACT_SPEC, master.config(**SMALL))
        store.register_host_pool(pool)
        yield store
        store.close()


def test_unreachable_master_fails_fast() -> None:
    start = time.monotonic()
    with pytest.raises(StorageUnavailable, match="unreachable"):
        MooncakeStore(CONTRACT_SPEC, {"master_address": "127.0.0.1:1", "connect_timeout_s": 0.5})
    assert time.monotonic() - start < 3


def test_master_restart_gives_unavailable_then_recovers() -> None:
    keys = make_keys(2)
    with HostPool(CONTRACT_SPEC, 4) as pool, LocalMaster() as master:
        store = MooncakeStore(CONTRACT_SPEC, master.config(**SMALL))
        store.register_host_pool(pool)
        pool.block(0).copy_(expected_block(keys[0], pool.block_bytes))
        assert store.put_from(keys[:1], [pool.block(0)]) == [True]
        master.stop()
        with pytest.raises(StorageUnavailable):
            store.exists_prefix(keys)
        with pytest.raises(StorageUnavailable):
            store.get_into(keys[:1], [pool.block(1)])
        master.start()  # same ports; the old master's objects are gone
        deadline = time.monotonic() + 30
        while True:
            try:
                if store.put_from(keys[1:], [pool.block(0)]) == [True]:
                    break
            except StorageUnavailable:
                pass
            assert time.monotonic() < deadline, "no recovery within 30 s"
            time.sleep(0.2)
        assert store.exists_prefix(keys) == 0  # key 0 was lost with the master: a miss
        assert store.exists_prefix(keys[1:]) == 1
        store.close()


def test_config_from_dict_and_env() -> None:
    """KVTIER_MOONCAKE_<FIELD> variables are read at the edge (kvtier.worker.config, the CLI),
    between the YAML and the flags, as every other setting."""
    env = {
        "KVTIER_MOONCAKE_MASTER_ADDRESS": "10.0.0.1:5000",
        "KVTIER_MOONCAKE_GLOBAL_SEGMENT_SIZE": "4096",
        "KVTIER_MOONCAKE_PROTOCOL": "rdma",
    }
    flags = Source("flags", {"storage": {"backend": "mooncake", "protocol": "tcp"}})
    merged = merge([*env_sources(env), flags]).values["storage"]
    cfg = MooncakeConfig.from_dict(merged)
    assert (cfg.master_address, cfg.global_segment_size, cfg.protocol) == (
        "10.0.0.1:5000",
        4096,
        "tcp",
    )  # the flags win over the environment
    with pytest.raises(ConfigError, match="storage.protocol: got 'udp'"):
        MooncakeConfig.from_dict({"protocol": "udp"})
    with pytest.raises(ConfigError, match="storage.master_address: must be host:port"):
        MooncakeConfig.from_dict({"master_address": "nowhere"})
    sources = [*env_sources({"KVTIER_MOONCAKE_GLOBAL_SEGMENT_SIZE": "big"}), flags]
    with pytest.raises(ConfigError, match="storage.global_segment_size: must be an integer"):
        MooncakeConfig.from_dict(merge(sources).values["storage"])
    with pytest.raises(ConfigError, match="storage.segment: unknown option"):
        MooncakeConfig.from_dict({"segment": 1})


def test_a_master_that_accepts_but_never_answers_cannot_hang_setup() -> None:
    """The port probe passes, then setup() used to hang for over 240 s."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    port = silent.getsockname()[1]
    try:
        start = time.monotonic()
        with pytest.raises(StorageUnavailable, match="did not answer setup in time"):
            MooncakeStore(
                CONTRACT_SPEC,
                {
                    "master_address": f"127.0.0.1:{port}",
                    "metadata_server": f"http://127.0.0.1:{port}/metadata",
                    "setup_timeout_s": 2.0,
                    **SMALL,
                },
            )
        assert time.monotonic() - start < 10
    finally:
        silent.close()


def test_a_frozen_master_costs_one_deadline_then_fails_fast() -> None:
    """A frozen master made every call wait ~30 s and answer "miss"; now the first call waits
    call_timeout_s, the next ones fail at once, and the store recovers when it thaws."""
    import os
    import signal

    with LocalMaster() as m:
        store = make_backend(CONTRACT_SPEC, m.config(call_timeout_s=2.0, **SMALL))
        keys = make_keys(2)
        with HostPool(CONTRACT_SPEC, 2) as pool:
            store.register_host_pool(pool)
            assert store.put_from(keys, [pool.block(0), pool.block(1)]) == [True, True]
            os.kill(m.process.pid, signal.SIGSTOP)
            try:
                start = time.monotonic()
                with pytest.raises(StorageUnavailable, match="did not answer"):
                    store.exists_prefix(keys)
                assert time.monotonic() - start < 6
                start = time.monotonic()
                with pytest.raises(StorageUnavailable, match="not answering"):
                    store.exists_prefix(keys)
                assert time.monotonic() - start < 0.5
            finally:
                os.kill(m.process.pid, signal.SIGCONT)
            deadline = time.monotonic() + 60
            while True:
                try:
                    assert store.exists_prefix(keys) == 2
                    break
                except StorageUnavailable:
                    assert time.monotonic() < deadline, "no recovery after the thaw"
                    time.sleep(0.2)
            store.unregister_host_pool(pool)
        store.close()


def test_only_registered_blocks_are_reachable(master) -> None:
    """Mooncake's peers can read registered memory: a worker registers its staging only."""
    from kvtier.errors import StorageError

    store = make_backend(CONTRACT_SPEC, master.config(**SMALL))
    try:
        with HostPool(CONTRACT_SPEC, 8) as pool:
            store.register_host_pool(pool, range(6, 8))
            keys = make_keys(2)
            for i, key in zip((6, 7), keys):
                pool.block(i).copy_(expected_block(key, pool.block_bytes))
            assert store.put_from(keys, [pool.block(6), pool.block(7)]) == [True, True]
            with pytest.raises(StorageError, match="not a registered block"):
                store.get_into(keys[:1], [pool.block(0)])
            pool.block(6).zero_()
            assert store.get_into(keys[:1], [pool.block(6)]) == [True]
            assert torch.equal(pool.block(6), expected_block(keys[0], pool.block_bytes))
            store.unregister_host_pool(pool)
    finally:
        store.close()


def _run_python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )


def test_a_missing_libibverbs_is_named_with_its_package(tmp_path) -> None:
    """The dynamic loader finds a broken libibverbs.so.1 first (LD_LIBRARY_PATH), as it would
    find none on a machine without the package: the backend and the local master both say
    which library is missing and what to install."""
    broken = tmp_path / "lib"
    broken.mkdir()
    (broken / "libibverbs.so.1").write_bytes(b"not a library")
    env = {**os.environ, "LD_LIBRARY_PATH": str(broken)}
    backend = _run_python(
        "from kvtier.storage.mooncake.config import import_mooncake\n"
        "from kvtier.errors import StorageError\n"
        "try:\n    import_mooncake()\nexcept StorageError as e:\n    print(e)\n",
        env,
    )
    assert "libibverbs" in backend.stdout and "apt-get install -y libibverbs1" in backend.stdout
    master = _run_python(
        "from kvtier.storage.mooncake.local import LocalMaster\n"
        "from kvtier.errors import StorageError\n"
        "try:\n    LocalMaster().start(timeout_s=20)\nexcept StorageError as e:\n    print(e)\n",
        env,
    )
    assert "apt-get install -y libibverbs1" in master.stdout, master.stdout + master.stderr


def test_mooncake_master_is_found_next_to_python_without_path() -> None:
    """An unactivated virtual environment: its bin is not on PATH, yet `mooncake_master`
    beside its Python is found and starts."""
    beside = Path(sys.executable).parent / "mooncake_master"
    if not beside.is_file():
        pytest.skip(f"mooncake_master is not installed beside {sys.executable}")
    out = _run_python(
        "from kvtier.storage.mooncake.local import LocalMaster, find_master_binary\n"
        "print(find_master_binary())\n"
        "with LocalMaster() as m:\n    print('started', m.master_address)\n",
        {**os.environ, "PATH": "/nonexistent"},
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == str(beside) and lines[1].startswith("started 127.0.0.1:")


@pytest.mark.parametrize("authenticated", [False, True], ids=["plain", "mac"])
def test_a_memory_tier_over_mooncake_serves_its_hits_directly_and_the_rest_from_the_cluster(
    master, tmp_path, authenticated: bool
) -> None:
    """Two engines, each with a memory tier over one Mooncake cluster (real workers, CPU
    caches): B loads what A saved from the cluster (its memory tier has none of it) through
    its staging, in the same load as its memory hits (straight into the device blocks), every
    byte A's; what came from the cluster is promoted, so B's next load is all memory hits.
    With a MAC key the staging is never trusted: A's writer MACs private copies, B checks
    its loads in private blocks before they reach the device and promotes only then."""
    from kvtier.transport import tasks as t
    from worker_helpers import block, engine, hashes, same

    storage = {"tiers": [{"backend": "memory", "capacity_bytes": 32 << 20}, master.config(**SMALL)]}
    if authenticated:
        key = tmp_path / "mac.key"
        key.write_text(os.urandom(32).hex())
        key.chmod(0o600)
        storage["mac_key_file"] = str(key)
    with (
        engine(tmp_path / "a", storage=storage) as (a, a_caches),
        engine(tmp_path / "b", storage=storage) as (b, b_caches),
    ):
        h = hashes(6, seed=21)
        assert a.save(h, list(range(6))).status is t.Status.OK
        deadline = time.monotonic() + 60  # A's writer puts them into the cluster after answering
        while b.lookup_tiers(h) != (6, bytes([1] * 6)):
            assert time.monotonic() < deadline, b.lookup_tiers(h)
            time.sleep(0.05)
        assert b.load(h[:2], [30, 31]).blocks == [30, 31]  # from the cluster, and promoted
        assert b.lookup_tiers(h) == (6, bytes([0, 0, 1, 1, 1, 1]))
        dev = [10, 11, 12, 13, 14, 15]
        assert b.load(h, dev).blocks == dev  # 2 from memory, 4 through 4 staging blocks
        for a_cache, b_cache in zip(a_caches, b_caches):
            assert all(same(block(b_cache, d), block(a_cache, i)) for i, d in enumerate(dev))
        assert b.lookup_tiers(h) == (6, b"")  # promoted: all in B's memory tier now
        assert b.load(h, [20, 21, 22, 23, 24, 25]).blocks == [20, 21, 22, 23, 24, 25]
        for a_cache, b_cache in zip(a_caches, b_caches):
            assert all(same(block(b_cache, 20 + i), block(a_cache, i)) for i in range(6))


# A peer of the cluster: its own transfer engine, knowing only the metadata server, a segment
# name and an address, writes 4 KiB of 0xAB there (Mooncake serves it: no authentication).
_PEER_WRITE = """
import ctypes, sys
from mooncake.engine import TransferEngine
metadata, segment, address = sys.argv[1], sys.argv[2], int(sys.argv[3])
engine = TransferEngine()
assert engine.initialize("127.0.0.1", metadata, "tcp", "") == 0
buffer = engine.allocate_managed_buffer(4096)
ctypes.memset(buffer, 0xAB, 4096)
assert engine.transfer_sync_write(segment, buffer, address, 4096) == 0
"""


def test_a_peer_writing_a_workers_staging_gets_none_of_its_bytes_in(master, tmp_path) -> None:
    """The attack with real parts: another Mooncake transfer engine writes into a worker's
    registered load staging right after the store fetched objects there (and checked their
    headers), before the worker copies them on. With a MAC key the worker checks each payload
    only once it is out of the staging, in memory no peer can reach: the load stops at the
    written block and its device block never holds the peer's bytes; a host load zeroes its
    host block. (Before stop 49 a host load took the peer's bytes as the stored ones.)"""
    import numpy as np

    from conftest import fill_random
    from kvtier.layout.keys import KeyScheme
    from kvtier.memory.device import DeviceCache, cache_name
    from kvtier.memory.host import HostLayout
    from kvtier.transport import tasks as t
    from kvtier.worker.datapath import DataPath
    from worker_helpers import WSPEC, block, hashes, same

    key = tmp_path / "mac.key"
    key.write_text(os.urandom(32).hex())
    key.chmod(0o600)
    store = make_backend(WSPEC, {**master.config(**SMALL), "mac_key_file": str(key)})
    layout = HostLayout(engine_blocks=8, staging_blocks=4)
    name = cache_name(f"atk{os.getpid()}", 0)
    with DeviceCache.create(WSPEC, name) as cache, HostPool(WSPEC, layout.total_blocks) as pool:
        fill_random(cache, 5)
        path, keys = DataPath(cache, pool, layout, store), KeyScheme("a", WSPEC.fingerprint, 0, "")
        target = pool.block(int(layout.load_staging[1])).data_ptr()
        read, attacks = store.read, []

        def fetched_then_written(request):
            got = read(request)
            peer = [master.metadata_server, store._store.get_hostname(), str(target)]
            done = subprocess.run([sys.executable, "-c", _PEER_WRITE, *peer], timeout=60)
            attacks.append(done.returncode)
            return got

        h = hashes(3, seed=43)
        want = [block(cache, b) for b in range(3)]
        assert path.run(t.Save(block_hashes=h, device_block_ids=[0, 1, 2]), keys).blocks
        for i in range(3):
            pool.block(i).copy_(torch.from_numpy(np.full(WSPEC.block_bytes, 40 + i, np.uint8)))
        hosted = hashes(3, seed=44)
        assert path.run(t.SaveHost(block_hashes=hosted, host_block_ids=[0, 1, 2]), keys).blocks
        store.read = fetched_then_written
        loaded = path.run(t.Load(block_hashes=h, device_block_ids=[20, 21, 22]), keys)
        host = path.run(t.LoadHost(block_hashes=hosted, host_block_ids=[4, 5, 6]), keys)
        store.read = read
        assert attacks == [0, 0]  # the peer's writes went through both times
        assert loaded.blocks == [20] and same(block(cache, 20), want[0])
        assert not any(torch.all(piece[:64] == 0xAB) for piece in block(cache, 21))
        assert host.blocks == [4] and not torch.any(pool.block(5))
        assert store.stats.corrupt == 2
        path.close()
    store.close()
