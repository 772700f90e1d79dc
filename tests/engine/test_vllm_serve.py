"""``vllm serve`` with kvtier as operators run it: OpenAI completions identical to a server
without kvtier, hits from kvtier's store, and stops — Ctrl-C of the whole group, SIGTERM of the
API server alone (the producer's) — that leave nothing: no process, segment, socket, lock or
launch directory.
Prefill/decode disaggregation: a producer (``kv_producer``) and a consumer (``kv_consumer``)
sharing a store behind ``kvtier pd-proxy`` or vLLM's own ``vllm-router`` answer as one server
would, the consumer loading what the producer computed; with the producer gone, the proxy's
consumer recomputes (vllm-router fails the request). vllm-router also routes over two kv_both
servers on one store.

The servers are started once for the module, side by side (each start costs 20-60 s here), by
the driver ``kvtier bench serve`` uses (``kvtier_bench.vllm_server``).
"""

from __future__ import annotations

import signal
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvtier.ops import pd_proxy
from kvtier_bench.vllm_leftovers import stop_all
from kvtier_bench.vllm_server import STOP_TIMEOUT_S, Router, Server

# These servers check kvtier's bytes, not its policy: every stored prefix is loaded (on this test
# model a prefill costs milliseconds, and on a busy machine the decision rightly declines loads).
BYTES_NOT_POLICY = {"load_or_recompute": False}
PREFIX = list(range(3, 515))  # 512 shared tokens: 4 full blocks of 128
PROMPTS = [PREFIX + [600 + 7 * i + j % 5 for j in range(100)] for i in range(3)]


@pytest.fixture(scope="module")
def servers(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")

    def kvtier(name: str) -> Server:
        store = {"backend": "file", "root": str(root / f"store-{name}")}
        return Server(model, root / name, kvtier={"storage": store, **BYTES_NOT_POLICY})

    shared = {"backend": "file", "root": str(root / "store-pd")}
    ctrl_c = kvtier("ctrl_c")
    started = {
        "plain": Server(model, root / "plain"),
        "ctrl_c": ctrl_c,
        # a second kv_both server on ctrl_c's store: vllm-router in front of the two
        "second": Server(model, root / "second", kvtier=ctrl_c.kvtier),
        "producer": Server(
            model, root / "producer", kvtier={"storage": shared, **BYTES_NOT_POLICY}
        ),
        "consumer": Server(
            model, root / "consumer", kvtier={"storage": shared, **BYTES_NOT_POLICY}
        ),
    }
    started["producer"].kv_role = "kv_producer"
    started["consumer"].kv_role = "kv_consumer"
    try:
        for server in started.values():
            server.start()
        with ThreadPoolExecutor(len(started)) as pool:
            list(pool.map(Server.wait_ready, started.values()))
        yield started
    finally:
        stop_all(started.values())  # as Ctrl-C does: SIGKILLed, vLLM leaves its /dev/shm objects


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


def _objects(server: Server) -> int:
    return len(list(Path(server.kvtier["storage"]["root"], "objects").rglob("*.kvb")))


def _stored(server: Server, count: int, timeout_s: float = 120.0) -> None:
    """Wait for ``count`` objects in the server's store: a kv_both server answers before its
    saves are (an idle server takes no step to report them: the store itself is read)."""
    deadline = time.monotonic() + timeout_s
    while _objects(server) < count:
        assert time.monotonic() < deadline, f"{_objects(server)} of {count} objects stored"
        time.sleep(0.1)


ROUTED = [list(range(40 + i, 40 + i + 600)) for i in range(2)]  # 4 full blocks each


def test_vllm_router_in_front_of_two_servers_on_one_store(servers, tmp_path, figures) -> None:
    """vllm-router (round robin, then cache aware) over two kv_both servers sharing a store
    (ctrl_c's, before its own test stops it):
    its answers are vLLM's, and a prompt the first server computed is loaded by the second."""
    first, second = servers["ctrl_c"], servers["second"]
    reference = {tuple(p): servers["plain"].complete(p) for p in ROUTED}
    workers = ["--worker-urls", first.url, second.url]
    with Router([*workers, "--policy", "round_robin"], tmp_path / "rr") as router:
        through = Server(first.model, first.workdir, port=router.port)
        before = [first.metrics(), second.metrics()]
        objects = _objects(first)
        for n, prompt in enumerate(ROUTED, 1):  # once to one server, once to the other
            assert through.complete(prompt) == reference[tuple(prompt)]
            _stored(first, objects + 4 * n)
            assert through.complete(prompt) == reference[tuple(prompt)]
        loaded = sum(
            _moved(b, s.metrics()).get("vllm:kvtier_loaded_tokens_total", 0)
            for b, s in zip(before, (first, second))
        )
    aligned = sum(len(p) // 128 * 128 for p in ROUTED)
    figures["round_robin_loaded_share"] = loaded / aligned
    assert loaded >= 0.9 * aligned
    with Router([*workers, "--policy", "cache_aware"], tmp_path / "ca") as router:
        through = Server(first.model, first.workdir, port=router.port)
        for prompt in ROUTED * 2:
            assert through.complete(prompt) == reference[tuple(prompt)]


def test_ctrl_c_of_the_server_group_leaves_nothing(servers) -> None:
    server = servers["ctrl_c"]
    server.complete(PROMPTS[0])  # the kvtier worker exists and has saved
    seconds = server.stop("group", signal.SIGINT)
    assert server.process.returncode is not None
    assert seconds < STOP_TIMEOUT_S
    assert server.leftovers() == []


LONG = [list(range(20 + i, 20 + i + 1000)) for i in range(2)]  # 7 full blocks each


def test_prefill_decode_behind_vllm_router(servers, tmp_path) -> None:
    """vllm-router's own P/D mode in front of a producer and a consumer sharing a store: each
    request goes to the producer, then to the consumer, which loads every full block."""
    producer, consumer = servers["producer"], servers["consumer"]
    pd = ["--vllm-pd-disaggregation", "--prefill", producer.url, "--decode", consumer.url]
    # 7 full blocks each, token ids below the vocabulary's 1024, none of LONG's prefixes
    prompts = [[(5 * j + 3 * i) % 1000 + 10 for j in range(1000)] for i in range(2)]
    with Router([*pd, "--policy", "round_robin"], tmp_path / "pd") as router:
        through = Server(producer.model, producer.workdir, port=router.port)
        objects, before = _objects(producer), consumer.metrics()
        answers = [through.complete(p) for p in prompts]
        assert answers == [servers["plain"].complete(p) for p in prompts]
        assert _objects(producer) == objects + 2 * 7
        moved = _moved(before, consumer.metrics())
        assert moved["vllm:kvtier_loaded_tokens_total"] == 2 * 7 * 128
        assert moved.get("vllm:kvtier_save_tasks_total", 0) == 0


def test_prefill_decode_through_the_proxy_answers_as_one_server(servers, tmp_path) -> None:
    """Why kvtier keeps its proxy beside vllm-router: with the producer gone, the proxy's
    consumer recomputes and answers, where vllm-router's P/D mode fails the request (HTTP 500,
    "Prefill request ... failed"). Should vllm-router learn to fall back, this test says so."""
    producer, consumer = servers["producer"], servers["consumer"]
    proxy = pd_proxy.serve(producer.url, consumer.url, "127.0.0.1", 0, 300.0)
    pd = ["--vllm-pd-disaggregation", "--prefill", producer.url, "--decode", consumer.url]
    router = Router([*pd, "--policy", "round_robin"], tmp_path / "pd").__enter__()
    try:
        through = Server(producer.model, producer.workdir, port=proxy.server_address[1])
        before_p, before_c = producer.metrics(), consumer.metrics()
        objects = _objects(producer)
        answers = [through.complete(p) for p in LONG]
        assert answers == [servers["plain"].complete(p) for p in LONG]
        # The producer answered once every full block was stored (its counters reach /metrics a
        # step later, and an idle producer takes no step: the store itself is read).
        assert _objects(producer) == objects + 2 * 7
        assert _moved(before_p, producer.metrics()).get("vllm:kvtier_lookups_total", 0) == 0
        # The consumer loaded them (its prefill was a load) and saved nothing.
        moved_c = _moved(before_c, consumer.metrics())
        assert moved_c["vllm:kvtier_loaded_tokens_total"] == 2 * 7 * 128
        assert moved_c.get("vllm:kvtier_save_tasks_total", 0) == 0
        assert proxy.counts == {"requests": 2, "prefill_failures": 0, "refused": 0}
        # SIGTERM to the producer's API server (as a service manager stops it) leaves nothing;
        # with the producer gone, the consumer recomputes, and the answer is the same.
        assert producer.stop("main", signal.SIGTERM) < STOP_TIMEOUT_S
        assert producer.leftovers() == []
        other = [(3 * j) % 1000 + 10 for j in range(1000)]  # ids < the vocabulary's 1024
        assert through.complete(other) == servers["plain"].complete(other)
        assert proxy.counts["prefill_failures"] == 1
        routed = Server(producer.model, producer.workdir, port=router.port)
        with pytest.raises(urllib.error.HTTPError, match="500"):
            routed.complete(other)
    finally:
        router.__exit__(None, None, None)
        proxy.shutdown()
        proxy.server_close()


def _moved(before: dict, after: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}
