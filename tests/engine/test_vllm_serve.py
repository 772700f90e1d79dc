"""``vllm serve`` with kvtier as operators run it: OpenAI completions identical to a server
without kvtier, hits from kvtier's store, and stops — Ctrl-C of the whole group, SIGTERM of the
API server alone — that leave nothing: no process, segment, socket, lock or launch directory.

The servers are started once for the module, side by side (each start costs 20-60 s here), by
the driver ``kvtier bench serve`` uses (``kvtier_bench.vllm_server``).
"""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtier_bench.vllm_server import STOP_TIMEOUT_S, Server

PREFIX = list(range(3, 515))  # 512 shared tokens: 4 full blocks of 128
PROMPTS = [PREFIX + [600 + 7 * i + j % 5 for j in range(100)] for i in range(3)]


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")

    def kvtier(name: str) -> Server:
        store = {"backend": "file", "root": str(root / f"store-{name}")}
        return Server(model, root / name, kvtier={"storage": store})

    started = {
        "plain": Server(model, root / "plain"),
        "ctrl_c": kvtier("ctrl_c"),
        "sigterm": kvtier("sigterm"),
    }
    try:
        for server in started.values():
            server.start()
        with ThreadPoolExecutor(len(started)) as pool:
            list(pool.map(Server.wait_ready, started.values()))
        yield started
    finally:
        for server in started.values():
            if server.process is not None and server.process.poll() is None:
                server.stop("group", signal.SIGKILL)
            server.kill_marked()


def test_completions_are_vllms_and_hits_come_from_kvtier(servers) -> None:
    plain, served = servers["plain"], servers["ctrl_c"]
    reference = [plain.complete(p) for p in PROMPTS]
    assert [served.complete(p) for p in PROMPTS] == reference  # first run: misses, saved
    served.reset_prefix_cache()  # vLLM's own cache is empty: any hit is kvtier's
    before = served.metrics()
    assert [served.complete(p) for p in PROMPTS] == reference
    after = served.metrics()
    moved = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert moved["vllm:kvtier_loaded_tokens_total"] >= len(PREFIX)
    assert moved["vllm:external_prefix_cache_hits_total"] >= len(PREFIX)
    assert moved["vllm:kvtier_failed_tokens_total"] == 0
    assert after["vllm:kvtier_saved_tokens_total"] >= len(PREFIX)


def test_ctrl_c_of_the_server_group_leaves_nothing(servers) -> None:
    server = servers["ctrl_c"]
    server.complete(PROMPTS[0])  # the kvtier worker exists and has saved
    seconds = server.stop("group", signal.SIGINT)
    assert server.process.returncode is not None
    assert seconds < STOP_TIMEOUT_S
    assert server.leftovers() == []


def test_sigterm_of_the_api_server_leaves_nothing(servers) -> None:
    server = servers["sigterm"]
    assert server.complete(PROMPTS[1]) == servers["plain"].complete(PROMPTS[1])
    seconds = server.stop("main", signal.SIGTERM)
    assert seconds < STOP_TIMEOUT_S
    assert server.leftovers() == []
