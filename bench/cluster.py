"""Engines that share a Mooncake cluster, and prefill/decode through it, as ``vllm serve`` runs.

A Mooncake master and a storage node on loopback; every engine is a pure Mooncake client (its
objects live on the node), all with one MAC key (``--no-mac``: checksums only). Three measures,
each round with new prompts:

(a) **Shared prefixes.** Engine A computes a set of prompts (its saves go to the cluster); then
    engine B answers them — loaded from the store — and, as its own baseline, a set nobody saw
    (B computes them). The same server, the same round, the order alternating; vLLM's prefix
    cache reset before each set. B's completions must equal A's.
(b) **Prefill/decode.** A producer and a consumer (``kv_producer`` / ``kv_consumer``), each on
    half the cores, against one instance without a connector on all of them. Per prompt the
    producer computes it (``max_tokens`` 1) and the consumer answers: the consumer's TTFT is a
    load; the single instance's is a prefill, timed while the P/D servers idle (a vLLM worker
    spin-waits on its cores for a second after each step: timed right after them, the single
    instance paid for their spin, 1.16 s instead of ~0.5 s). Then a set through ``kvtier
    pd-proxy`` with several in flight: end-to-end TTFT and requests/s. Completions must equal the
    single one's.
(c) **Load bandwidth.** B's loads in (a) (bytes over the workers' load time) beside Mooncake's
    own ``batch_get_into`` of as many objects as one of B's loads, of the same size, from the
    same node: timed while B serves unseen prompts, in each round right after B's loads (on a
    small machine the get's receive copies compete for the CPU with the engine, as B's loads
    do; timed once after all rounds it read 0.40-0.96 GB/s from run to run, so each round's
    loads are divided by their own round's get), and once on an idle machine.

Servers start once (their start is minutes on a busy machine); rounds use fresh prompts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kvtier.common.cpus import format_cpu_list
from kvtier.transport import auth
from kvtier_bench import serve_load as load
from kvtier_bench.cluster_report import print_report, rows_of
from kvtier_bench.common import print_json_rows, progress
from kvtier_bench.storage_raw import raw_mooncake_gbps
from kvtier_bench.vllm_server import Server

BLOCK = 128  # vLLM's block size on CPU: what a hit can cover
# A's saves are answered off its critical path, seconds after its answers on a busy machine: B
# looks them up once they are stored, or after this bound (a save declined or lost: the checks
# line says which).
SAVES_BOUND_S = 30.0
# Before Mooncake's own gets beside B: B's first prompts reach its engine (HTTP, scheduling).
BUSY_SETTLE_S = 0.3
# vLLM's workers spin-wait on their cores for a second after every step (shm_broadcast's
# busy_loop_s): a server timed right after another one ran on shared cores pays for its spin.
SPIN_SETTLE_S = 1.5
COUNTERS = {
    "found_tokens": "vllm:kvtier_found_tokens_total",
    "declined_tokens": "vllm:kvtier_declined_tokens_total",
    "loaded_tokens": "vllm:kvtier_loaded_tokens_total",
    "failed_tokens": "vllm:kvtier_failed_tokens_total",
    "load_bytes": "vllm:kvtier_load_bytes_total",
    "load_microseconds": "vllm:kvtier_load_microseconds_total",
    "load_core_wait_microseconds": "vllm:kvtier_load_core_wait_microseconds_total",
}

A_COUNTERS = {
    "saved_tokens": "vllm:kvtier_saved_tokens_total",
    "unsaved_tokens": "vllm:kvtier_unsaved_tokens_total",
    "save_failures": "vllm:kvtier_save_failures_total",
}


@dataclass
class Cluster:
    master: Any
    node: Any
    storage: dict[str, Any]

    def stop(self) -> None:
        for process in (self.node, self.master):
            process.stop()


def start_cluster(root: Path, segment_bytes: int, mac: bool = True) -> Cluster:
    """A master and a storage node; ``mac``: the engines' objects carry kvtier's MAC (one key)."""
    from kvtier.storage.mooncake.local import LocalMaster, LocalStoreNode

    if mac:
        auth.write_key(root / "mac.key")
    master = LocalMaster().start()
    try:
        node = LocalStoreNode(master, segment_bytes).start()
    except BaseException:
        master.stop()
        raise
    storage = master.config(
        global_segment_size=0,  # pure clients: the objects live on the node
        local_buffer_size=64 << 20,
        local_hostname="127.0.0.1",
    )
    if mac:
        storage["mac_key_file"] = str(root / "mac.key")
    return Cluster(master, node, storage)


def halves() -> tuple[str, str, str]:
    """CPU lists: the producer's, the consumer's, and the single instance's (all of them)."""
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    first, second = set(cores[:half]), set(cores[half:] or cores[:half])
    return format_cpu_list(first), format_cpu_list(second), format_cpu_list(set(cores))


def server(
    args,
    model: str,
    root: Path,
    name: str,
    role: str | None,
    cores: str | None = None,
    storage=None,
):
    """A server of the cluster (``role``: a kv role) or, with ``role`` None, one without kvtier;
    ``cores``: its OpenMP binding (and no reserved core), else the bench serve default;
    ``storage``: instead of the cluster."""
    extra = None
    if role is not None:
        extra = {**json.loads(args.kvtier_settings), "storage": storage or args.storage}
        extra["namespace"] = "bench-cluster"
    env = {"VLLM_CPU_OMP_THREADS_BIND": cores} if cores else {}
    return Server(
        model,
        root / name,
        kvtier=extra,
        kv_role=role or "kv_both",
        kv_bytes=args.kv_bytes,
        max_num_seqs=max(8, args.concurrency),
        reserved_cpus=0 if cores else 1,
        env=env,
    )


def start_all(servers: list[Server]) -> None:
    for s in servers:
        s.start()
    for s in servers:
        progress(f"  {s.workdir.name} ready in {s.wait_ready():.0f} s")
        s.complete([5, 6, 7, 8], 2)  # warm-up, unrelated to every prompt set


def sessions(tag: int, args) -> list[load.Session]:
    return load.no_reuse(tag, args.prompts, args.prompt_tokens)


def loadable(session: load.Session) -> int:
    """The tokens of a session's prompt that a hit can cover: whole blocks, the last token
    never (vLLM computes it)."""
    return (len(session.turns[0]) - 1) // BLOCK * BLOCK


def measured(srv: Server, work: list[load.Session], concurrency: int, output: int) -> dict:
    srv.reset_prefix_cache()
    before = srv.metrics()
    records = load.run(srv, work, concurrency, output)
    after = srv.metrics()
    out = {k: after.get(v, 0) - before.get(v, 0) for k, v in COUNTERS.items()}
    return {
        **load.figures(records),
        **out,
        "tokens": [r.tokens for r in records],
        "load_average": os.getloadavg()[0],
    }


def shared_round(args, a: Server, b: Server, r: int) -> dict[str, Any]:
    shared, alone = sessions(100 + r, args), sessions(200 + r, args)
    a.reset_prefix_cache()
    before = a.metrics()
    saves_before = a.saves()
    reference = [rec.tokens for rec in load.run(a, shared, 1, args.output_tokens)]
    waited = time.monotonic()
    stored = a.wait_saved(sum(loadable(s) for s in shared) // BLOCK, saves_before, SAVES_BOUND_S)
    after = a.metrics()
    out: dict[str, Any] = {  # what A saved, and left unsaved (load_or_recompute's estimates)
        f"a_{name}": after.get(metric, 0) - before.get(metric, 0)
        for name, metric in A_COUNTERS.items()
    }
    out.update(a_saves_stored=stored, a_saves_wait_s=time.monotonic() - waited)
    for which in ("shared", "alone") if r % 2 == 0 else ("alone", "shared"):
        work = shared if which == "shared" else alone
        out[which] = measured(b, work, args.concurrency, args.output_tokens)
    out["identical"] = out["shared"]["tokens"] == reference
    aligned = sum(loadable(s) for s in shared)
    out["hit_fraction"] = out["shared"]["loaded_tokens"] / aligned
    return out


def pd_round(args, producer: Server, consumer: Server, single: Server, proxy, r: int) -> dict:
    one_by_one, through = sessions(300 + r, args), sessions(400 + r, args)
    for s in (producer, consumer, single):
        s.reset_prefix_cache()
    # The single instance shares the P/D servers' cores: each side is timed while the other
    # is idle (not spinning), the single instance first.
    time.sleep(SPIN_SETTLE_S)
    alone = [
        load.stream(single, s.turns[0], args.output_tokens, s.group, False) for s in one_by_one
    ]
    time.sleep(SPIN_SETTLE_S)
    consumer_ttft, prefill, end_to_end, identical = [], [], [], True
    for session, single_record in zip(one_by_one, alone):
        prompt = session.turns[0]
        p = load.stream(producer, prompt, 1, session.group, False)
        c = load.stream(consumer, prompt, args.output_tokens, session.group, False)
        consumer_ttft.append(c.ttft_s)
        prefill.append(p.end - p.start)
        end_to_end.append(p.end - p.start + c.ttft_s)
        identical &= c.tokens == single_record.tokens
    single_ttft = [r.ttft_s for r in alone]
    time.sleep(SPIN_SETTLE_S)
    both = {"single": measured(single, through, args.concurrency, args.output_tokens)}
    time.sleep(SPIN_SETTLE_S)
    both["proxy"] = measured(proxy, through, args.concurrency, args.output_tokens)
    return {
        "single_ttft_p50_s": statistics.median(single_ttft),
        "consumer_ttft_p50_s": statistics.median(consumer_ttft),
        "producer_prefill_p50_s": statistics.median(prefill),
        "pd_ttft_p50_s": statistics.median(end_to_end),
        "single": both["single"],
        "proxy": both["proxy"],
        "identical": identical and both["single"]["tokens"] == both["proxy"]["tokens"],
    }


class ProxyTarget(SimpleNamespace):
    """What ``serve_load`` needs of a server, for the proxy; its counters are the consumer's."""

    def reset_prefix_cache(self) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return self.consumer.metrics()


def run_proxy(producer: Server, consumer: Server) -> tuple[Any, ProxyTarget]:
    from kvtier.ops.pd_proxy import serve

    proxy = serve(producer.url, consumer.url, "127.0.0.1", 0, timeout_s=600.0)
    port = proxy.server_address[1]
    return proxy, ProxyTarget(host="127.0.0.1", port=port, model=producer.model, consumer=consumer)


def report(args: argparse.Namespace) -> int:
    from kvtier_bench.vllm_engine import model_or_built

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-cluster-") as tmp:
        root = Path(tmp)
        model = model_or_built(args.model, root)
        cluster = start_cluster(root, args.segment_bytes, mac=not args.no_mac)
        args.storage = cluster.storage
        try:
            shared, pd, raw = measure(args, model, root, cluster)
        finally:
            cluster.stop()
    rows = rows_of(shared, pd, raw)
    if args.json:
        print_json_rows(rows)
    else:
        print_report(rows, args)
    return 0


def measure(args, model: str, root: Path, cluster: Cluster):
    """(shared rounds, each with its raw Mooncake GB/s beside B serving; P/D rounds; raw
    Mooncake GB/s on an idle machine)."""
    shared: list[dict] = []
    raw: dict[str, float] = {}
    if not args.skip_shared:
        shared, raw = measure_shared(args, model, root, cluster)
    pd = [] if args.skip_pd else measure_pd(args, model, root)
    return shared, pd, raw


def measure_shared(args, model: str, root: Path, cluster: Cluster):
    a, b = (server(args, model, root, name, "kv_both") for name in ("a", "b"))
    progress("(a) engines A and B on the cluster")
    with running([a, b]):
        rounds = []
        # One of B's loads: one prompt's blocks (when every prompt of the set is a hit).
        objects = max(1, loadable(sessions(0, args)[0]) // BLOCK)
        for r in range(args.rounds):
            progress(f"  round {r + 1}/{args.rounds}")
            rounds.append(shared_round(args, a, b, r))
            progress(f"  (c) Mooncake's own get of {objects} objects, beside B serving")
            rounds[-1]["raw_busy_gbps"] = raw_beside(b, args, cluster.storage, objects, r)
    progress(f"(c) Mooncake's own get of {objects} objects, idle machine")
    return rounds, {"idle": raw_mooncake_gbps(cluster.storage, objects, args.raw_runs)}


def raw_beside(srv: Server, args, storage: dict, objects: int, r: int) -> float:
    """Mooncake's own get, timed while ``srv`` serves prompts nobody saw (computed there; round
    ``r`` has tags of its own). ``srv`` serves only while the gets are timed (before, its saves
    of prompts served during the child's start filled the node), and this returns once it
    stored their blocks, so that the next round's loads do not run beside these saves."""
    before, served = srv.saves(), [0]

    @contextlib.contextmanager
    def serving():
        done = threading.Event()

        def serve() -> None:
            tag = 1000 + 100 * r
            while not done.is_set():
                work = sessions(tag, args)
                load.run(srv, work, args.concurrency, args.output_tokens)
                served[0] += sum(loadable(s) for s in work) // BLOCK
                tag += 1

        busy = threading.Thread(target=serve, name="bench-cluster-busy", daemon=True)
        busy.start()
        time.sleep(BUSY_SETTLE_S)
        try:
            yield
        finally:
            done.set()
            busy.join()

    rate = raw_mooncake_gbps(storage, objects, args.raw_runs, serving)
    srv.wait_saved(served[0], before, SAVES_BOUND_S)
    return rate


def measure_pd(args, model: str, root: Path) -> list[dict]:
    progress(f"(b) a producer and a consumer ({args.pd_storage}) vs one instance on all cores")
    first, second, every = halves()
    pd_storage = None  # the cluster
    if args.pd_storage == "file":  # one machine: a shared file store
        pd_storage = {"backend": "file", "root": str(root / "pd-store")}
        if "mac_key_file" in args.storage:
            pd_storage["mac_key_file"] = args.storage["mac_key_file"]
    producer = server(args, model, root, "producer", "kv_producer", first, pd_storage)
    consumer = server(args, model, root, "consumer", "kv_consumer", second, pd_storage)
    single = server(args, model, root, "single", None, every)
    with running([producer, consumer, single]):
        proxy, target = run_proxy(producer, consumer)
        try:
            rounds = []
            for r in range(args.rounds):
                progress(f"  round {r + 1}/{args.rounds}")
                rounds.append(pd_round(args, producer, consumer, single, target, r))
            return rounds
        finally:
            proxy.shutdown()
            proxy.server_close()


@contextmanager
def running(servers: list[Server]):
    """The servers started and warmed up; stopped (with everything they started) after."""
    try:
        start_all(servers)
        yield
    finally:
        for s in servers:
            if s.process is not None and s.process.poll() is None:
                s.stop()
            s.kill_marked()


def main() -> int:
    from kvtier_bench.common import standalone
    from kvtier_bench.options import cluster_arguments

    return standalone("cluster", __doc__, cluster_arguments, report)


if __name__ == "__main__":
    raise SystemExit(main())
