"""Two vLLM engines sharing one Mooncake cluster through kvtier, as a cluster runs: a master, a
storage node and two ``vllm serve`` engines, each in its own network namespace with an address
that exists only there. Engine B hits the prefixes engine A computed, with A's tokens (A's first
answers are misses: vLLM computed them); objects carry kvtier's MAC, one key for the cluster.
Then the storage node dies: every request still completes, with the same tokens (recompute),
within its bound; and once a node is back, hits come back.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import require_mooncake, require_vllm
from kvtier import auth
from kvtier_bench.vllm_server import Server
from netcheck import Namespaces, namespaces_unavailable, start_role

BLOCK = 128
PROMPTS = [[(7 * i + 13 * j) % 900 + 30 for j in range(700)] for i in range(3)]  # 5 blocks each
SEGMENT_BYTES = 256 << 20  # the storage node's share: every object of this test, several times
FAULT_BOUND_S = 180.0  # one request while the store is gone: a recompute, never a hang


@pytest.fixture(scope="module")
def cluster(model, tmp_path_factory):
    require_vllm()
    require_mooncake()
    why = namespaces_unavailable()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("cluster")
    auth.write_key(root / "mac.key")
    with Namespaces(["master", "node", "a", "b"], subnet=78, reach_from_root=True) as net:
        roles = []
        engines: dict[str, Server] = {}
        try:
            master, info = start_role(net, "master")
            roles.append(master)
            node, _ = start_role(
                net, "node", info["master_address"], info["metadata"], str(SEGMENT_BYTES)
            )
            roles.append(node)
            for name in ("a", "b"):
                storage = {
                    "backend": "mooncake",
                    "master_address": info["master_address"],
                    "metadata_server": info["metadata"],
                    "local_hostname": net.addresses[name],
                    "global_segment_size": 0,  # a pure client: objects live on the node
                    "local_buffer_size": 64 << 20,
                    "mac_key_file": str(root / "mac.key"),
                }
                engines[name] = Server(
                    model,
                    root / name,
                    kvtier={"storage": storage, "namespace": "cluster-model"},
                    host=net.addresses[name],
                    netns=net.names[name],
                )
                engines[name].start()
            with ThreadPoolExecutor(2) as pool:
                list(pool.map(Server.wait_ready, engines.values()))
            yield {"net": net, "info": info, "roles": roles, **engines}
        finally:
            for server in engines.values():
                if server.process is not None and server.process.poll() is None:
                    server.stop("group", signal.SIGKILL)
                server.kill_marked()
            for process in roles:
                process.kill()
                process.wait(30)


def _moved(server: Server, before: dict) -> dict:
    after = server.metrics()
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def test_engine_b_hits_what_engine_a_computed(cluster) -> None:
    a, b = cluster["a"], cluster["b"]
    reference = [a.complete(p) for p in PROMPTS]  # misses: vLLM computed these, kvtier saved
    time.sleep(1)  # A's saves are answered off the critical path; B looks them up next
    before = b.metrics()
    assert [b.complete(p) for p in PROMPTS] == reference
    moved = _moved(b, before)
    full = sum((len(p) - 1) // BLOCK for p in PROMPTS)  # blocks a hit can cover
    assert moved["vllm:kvtier_loaded_tokens_total"] >= 0.9 * full * BLOCK
    assert moved["vllm:kvtier_failed_tokens_total"] == 0
    cluster["reference"] = reference


def test_a_dead_storage_node_costs_recomputes_never_wrong_tokens_or_hangs(cluster) -> None:
    a, b = cluster["a"], cluster["b"]
    fresh = [(11 * j) % 900 + 40 for j in range(700)]
    want = a.complete(fresh)
    node = cluster["roles"][1]
    node.kill()  # the storage node and its Mooncake process
    node.wait(30)
    for prompt, tokens in [(fresh, want), (PROMPTS[0], a.complete(PROMPTS[0]))]:
        b.reset_prefix_cache()
        start = time.monotonic()
        assert b.complete(prompt) == tokens
        assert time.monotonic() - start < FAULT_BOUND_S
    # A storage node again: new objects are saved and hit.
    net, info = cluster["net"], cluster["info"]
    node, _ = start_role(net, "node", info["master_address"], info["metadata"], str(SEGMENT_BYTES))
    cluster["roles"].append(node)
    again = [(17 * j) % 900 + 50 for j in range(700)]
    deadline = time.monotonic() + FAULT_BOUND_S
    while True:
        want = a.complete(again)
        time.sleep(1)
        b.reset_prefix_cache()
        before = b.metrics()
        assert b.complete(again) == want
        if _moved(b, before)["vllm:kvtier_loaded_tokens_total"] > 0:
            break
        assert time.monotonic() < deadline, "no hit came back after the storage node returned"
        a.reset_prefix_cache()
        again = [t + 1 for t in again]


def test_the_engines_stop_leaving_nothing(cluster) -> None:
    for name in ("a", "b"):
        server = cluster[name]
        assert server.stop("group", signal.SIGINT) < 60
        assert server.leftovers() == []
