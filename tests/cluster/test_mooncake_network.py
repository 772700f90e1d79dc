"""Mooncake has no authentication: nothing kvtier starts may listen beyond the configured host.

Mooncake's transfer engine binds every interface whatever host it is given, and its TCP
protocol serves reads of registered memory to any peer; the master's HTTP metadata server
(which hands out buffer addresses) binds every interface despite its host flag. kvtier starts
those processes with its bind guard (``kvtier.common.bindguard``). Checked twice: on one machine
(loopback) and as a cluster runs — a master, a storage node and two workers, each in its own
network namespace with an address that exists only there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from conftest import require_mooncake, require_namespaces
from kvtier.common import bindguard
from kvtier.engine.client import Client
from kvtier.memory.device import DeviceCache, cache_name
from kvtier.worker.config import WorkerConfig
from netcheck import Namespaces, listeners, start_role
from worker_helpers import FAST, WSPEC, block, engine, fill, hashes, same

TESTS = Path(__file__).resolve().parents[1]  # the helpers live at the top of tests/


@pytest.fixture(autouse=True)
def _mooncake_and_guard():
    require_mooncake()
    if bindguard.library() is None:
        pytest.fail("kvtier._bindguard is not built: reinstall kvtier with a C compiler")


def _only_on(host: str, addresses: set[str]) -> bool:
    return all(a.rsplit(":", 1)[0] == host for a in addresses)


def test_on_one_machine_everything_listens_on_loopback_only(tmp_path) -> None:
    from kvtier.storage.mooncake.local import LocalMaster, LocalStoreNode

    with LocalMaster() as master, LocalStoreNode(master, 64 << 20) as node:
        storage = master.config(global_segment_size=0, local_buffer_size=16 << 20)
        with engine(tmp_path, world_size=1, storage=storage) as (client, caches):
            h = hashes(3)
            assert client.save(h, [1, 2, 3]).blocks == [1, 2, 3]
            assert client.load(h, [20, 21, 22]).blocks == [20, 21, 22]
            for src, dst in zip((1, 2, 3), (20, 21, 22)):
                assert same(block(caches[0], src), block(caches[0], dst))
            # Host tasks pass through staging: the engine's host blocks are never registered.
            assert client.swap_out([4, 5], [0, 1]).blocks == [4, 5]
            h2 = hashes(2, seed=3)
            assert client.save_host(h2, [0, 1]).blocks == [0, 1]
            assert client.load_host(h2, [6, 7]).blocks == [6, 7]
            assert client.swap_in([6, 7], [24, 25]).blocks == [24, 25]
            assert same(block(caches[0], 4), block(caches[0], 24))
            assert same(block(caches[0], 5), block(caches[0], 25))
            assert client._launch is not None
            processes = {
                "mooncake_master": master.process.pid,
                "store node": node.process.pid,
                "worker": client._launch.processes[0].pid,
            }
            for who, pid in processes.items():
                found = listeners(pid)
                assert found, f"{who} listens nowhere: the check would prove nothing"
                assert _only_on("127.0.0.1", found), f"{who} listens beyond loopback: {found}"


def test_a_cluster_in_private_networks_moves_bytes_and_listens_only_where_configured(
    tmp_path,
) -> None:
    require_namespaces()
    roles = ["master", "node", "saver", "loader"]
    started: list[subprocess.Popen] = []
    caches: list[DeviceCache] = []
    clients: list[Client] = []
    with Namespaces(roles) as net:
        try:
            master, info = start_role(net, "master")
            started.append(master)
            node, node_info = start_role(
                net, "node", info["master_address"], info["metadata"], str(64 << 20)
            )
            started.append(node)
            pids = {"master": info["pid"], "node": node_info["pid"]}
            for role in ("saver", "loader"):
                instance = f"{role}{uuid.uuid4().hex[:6]}"
                cache = DeviceCache.create(WSPEC, cache_name(instance, 0))
                fill(cache, seed=len(caches) + 1)
                caches.append(cache)
                endpoint = f"ipc://{tmp_path}/{role}.sock"
                config = WorkerConfig(
                    spec=WSPEC,
                    instance_id=instance,
                    namespace="cluster",
                    endpoint=endpoint,
                    num_host_blocks=8,
                    staging_blocks=2,
                    parent_pid=os.getpid(),
                    storage={
                        "backend": "mooncake",
                        "master_address": info["master_address"],
                        "metadata_server": info["metadata"],
                        "local_hostname": net.addresses[role],
                        "global_segment_size": 0,
                        "local_buffer_size": 16 << 20,
                    },
                )
                path = tmp_path / f"{role}.yaml"
                path.write_text(yaml.safe_dump(config.to_dict()))
                log = open(tmp_path / f"{role}.log", "wb")  # noqa: SIM115 - closed with the test
                worker = net.run(
                    role,
                    [sys.executable, "-m", "kvtier.ops.cli", "serve", "--config", str(path)],
                    stdout=log,
                    stderr=log,
                    env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                )
                started.append(worker)
                pids[role] = worker.pid
                clients.append(Client.connect([endpoint], start_timeout_s=120, **FAST))
            saver, loader = clients
            h = hashes(4, seed=5)
            assert saver.save(h, [1, 2, 3, 4]).blocks == [1, 2, 3, 4]
            assert loader.load(h, [30, 31, 32, 33]).blocks == [30, 31, 32, 33]
            for src, dst in zip((1, 2, 3, 4), (30, 31, 32, 33)):
                assert same(block(caches[0], src), block(caches[1], dst))
            for role, pid in pids.items():
                found = listeners(pid, whole_namespace=True)
                assert found, f"nothing listens in the {role}'s namespace"
                assert _only_on(net.addresses[role], found), f"{role}: {found}"
        finally:
            for client in clients:
                client.close()
            for process in started:
                if process.stdin is not None:
                    process.stdin.close()
                process.terminate()
            for process in started:
                try:
                    process.wait(15)
                except subprocess.TimeoutExpired:
                    process.kill()
            for cache in caches:
                cache.close()
