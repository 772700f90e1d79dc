"""`vllm serve` with kvtier vs without, as operators run it, on one fair binding.

Each round starts a fresh server without a connector and a fresh one with kvtier (a new file
store), one at a time, in alternating order, and drives each through the same workloads with a
streaming OpenAI client: (a) prefix reuse, a working set 2-3x vLLM's own cache; (b) no reuse;
(c) a multi-turn chat; (d) high concurrency. vLLM's prefix cache is reset between workloads.
Both servers get the same CPU reservation (vLLM 0.32 on CPU reserves one more core per rank
when a KV connector is configured: on a small machine that changes how many cores compute).
Ratios are kvtier / no connector within a round, then the median over rounds.

``--ideal`` adds a third server per round: vLLM alone with a KV cache that holds every workload's
whole working set (``--ideal-kv-bytes``), so its own prefix cache hits everything a connector
could, at no cost. Its ratio to the no-connector server bounds what any connector can give on
this machine (a generous bound: its cache also has room to run every request at once, where the
others may queue for KV space).

``--null-connector`` adds a server with a connector that does nothing
(``kvtier_bench.null_connector``): its ratio to the no-connector server is what vLLM's connector
machinery costs before a connector does any work, the floor under kvtier's cost on misses.

``--tiered SIZE`` adds a kvtier server whose store has a memory tier of SIZE in front (same kind
of store, its own keys): its figures divided by the kvtier server's, round by round, are what the
memory tier gives — with ``--mooncake-link``, issue 30's (e), both sides measured in the same
rounds on the same link.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvtier.storage import with_memory_tier
from kvtier_bench import serve_load as load
from kvtier_bench.common import print_json_rows, progress, save_plot
from kvtier_bench.slow_link import mooncake_behind_link
from kvtier_bench.vllm_server import Server

COUNTERS = {
    "vllm_hit_tokens": "vllm:prefix_cache_hits_total",
    "external_hit_tokens": "vllm:external_prefix_cache_hits_total",
    "kvtier_loaded_tokens": "vllm:kvtier_loaded_tokens_total",
    "kvtier_in_step_loaded_tokens": "vllm:kvtier_in_step_loaded_tokens_total",
    "kvtier_failed_tokens": "vllm:kvtier_failed_tokens_total",
    "kvtier_declined_tokens": "vllm:kvtier_declined_tokens_total",
    "kvtier_unsaved_tokens": "vllm:kvtier_unsaved_tokens_total",
    "lookup_round_trips": "vllm:kvtier_lookup_round_trips_total",
    "lookup_microseconds": "vllm:kvtier_lookup_microseconds_total",
    "lookups_skipped": "vllm:kvtier_lookups_skipped_total",
    "save_tasks": "vllm:kvtier_save_tasks_total",
    "preemptions": "vllm:num_preemptions_total",
}
SHOWN = [  # (figure, label, goal for kvtier / no connector)
    ("requests_per_s", "requests/s", ">="),
    ("ttft_mean_s", "TTFT mean", "<="),
    ("ttft_p50_s", "TTFT p50", "<="),
    ("ttft_p90_s", "TTFT p90", "<="),
    ("ttft_p99_s", "TTFT p99", "<="),
    ("seen_ttft_p50_s", "TTFT p50, prefix seen before", "<="),
    ("seen_ttft_p99_s", "TTFT p99, prefix seen before", "<="),
    ("tpot_mean_s", "TPOT mean", "<="),
]
# The --null-connector server's connector, named, not imported (the harness never imports vLLM).
NULL_CONNECTOR = {
    "kv_connector": "NullConnector",
    "kv_connector_module_path": "kvtier_bench.null_connector",
    "kv_role": "kv_both",
}
# Servers a round may add beside the pair: label -> what the report calls it.
EXTRA = {
    "ideal": "ideal (vLLM alone, a cache for everything)",
    "null": "null connector (vLLM's connector machinery, no work)",
    "tiered": "kvtier with a memory tier in front of its store",
}


def workloads(args: argparse.Namespace) -> dict[str, tuple[list[load.Session], int, int]]:
    """name -> (sessions, concurrency, output tokens)."""
    every = {
        "prefix_reuse": (
            load.prefix_reuse(1, args.prefixes, args.prefix_tokens, args.repeats, 32),
            args.concurrency,
            args.output_tokens,
        ),
        "no_reuse": (
            load.no_reuse(2, args.unique_prompts, args.prefix_tokens),
            args.concurrency,
            args.output_tokens,
        ),
        "multi_turn": (
            load.chat(3, args.users, args.turns, args.first_turn_tokens, args.turn_tokens),
            args.chat_concurrency,
            args.answer_tokens,
        ),
        "high_concurrency": (
            load.prefix_reuse(4, args.hc_prefixes, args.hc_prefix_tokens, args.hc_repeats, 32),
            args.hc_concurrency,
            args.output_tokens,
        ),
    }
    return {name: every[name] for name in args.workloads.split(",")}


def reserved_cpus(args: argparse.Namespace) -> int:
    """What vLLM reserves with a connector at TP=1 (2), where that leaves a core to compute;
    else 1 — on both servers."""
    if args.reserved_cpus is not None:
        return args.reserved_cpus
    return 2 if len(os.sched_getaffinity(0)) > 4 else 1


def binding(server: Server) -> str:
    """The OpenMP binding vLLM logged: compute cores and reserved cores."""
    text = server.tail(10**7)
    cores = re.findall(r"core ids=(\[[^\]]*\])", text)
    reserved = re.findall(r"reserved_cpus=(\[[^\]]*\])", text)
    return f"compute {cores[-1] if cores else '?'} reserved {reserved[-1] if reserved else '?'}"


def one_server(args, model: str, root: Path, label: str, run: int, plan) -> dict[str, Any]:
    """One fresh server (``plain``, ``kvtier``, ``tiered``, ``ideal`` or ``null``) through every
    workload."""
    extra = None
    if label in ("kvtier", "tiered"):
        storage: dict[str, Any] = {
            **(args.cluster or {"backend": "file", "root": str(root / f"store-{label}{run}")}),
            **({"faults": json.loads(args.store_faults)} if args.store_faults else {}),
        }
        memory = args.memory_tier if label == "kvtier" else args.tiered
        if memory:
            storage = with_memory_tier(storage, memory)
        # Every server its own keys: a cluster outlives the run, and the prompts repeat.
        extra = {"namespace": f"bench-serve-{label}-{run}", **json.loads(args.kvtier_settings)}
        extra["storage"] = storage
    server = Server(
        model,
        root / f"{label}{run}",
        kvtier=extra,
        connector=NULL_CONNECTOR if label == "null" else None,
        kv_bytes=args.ideal_kv_bytes if label == "ideal" else args.kv_bytes,
        max_num_seqs=max(args.hc_concurrency, args.concurrency, args.chat_concurrency),
        reserved_cpus=reserved_cpus(args),
    )
    out: dict[str, Any] = {}
    try:
        server.start()
        out["ready_s"] = server.wait_ready()
        out["binding"] = binding(server)
        server.complete([5, 6, 7, 8], 2)  # warm-up, unrelated to every workload
        for name, (sessions, concurrency, output) in plan.items():
            server.reset_prefix_cache()
            before = server.metrics()
            records = load.run(server, sessions, concurrency, output)
            after = server.metrics()
            moved = {k: after.get(v, 0) - before.get(v, 0) for k, v in COUNTERS.items()}
            out[name] = {
                **load.figures(records),
                **moved,
                "tokens": [r.tokens for r in records],
                "seen": [r.seen for r in records],
                "load_average": os.getloadavg()[0],
            }
            progress(f"  {name}: {out[name]['requests_per_s']:.3f} requests/s")
        out["stop_s"] = server.stop()
        out["left"] = server.leftovers()
    finally:
        if server.process is not None and server.process.poll() is None:
            server.stop("group", 9)
        server.kill_marked()
    return out


def rows_of(rounds: list[dict[str, dict]], plan) -> list[dict[str, Any]]:
    rows = []
    for name in plan:
        pairs = [(r["plain"][name], r["kvtier"][name]) for r in rounds]
        same = sum(p["tokens"] == k["tokens"] for p, k in pairs)
        for figure, label, goal in SHOWN:
            values = [(p.get(figure), k.get(figure)) for p, k in pairs]
            values = [(p, k) for p, k in values if p and k is not None]
            if not values:
                continue
            row = {
                "workload": name,
                "measure": label,
                "figure": figure,
                "plain": statistics.median(p for p, _ in values),
                "kvtier": statistics.median(k for _, k in values),
                "ratio": statistics.median(k / p for p, k in values),
                "goal": goal,
                "rounds": len(values),
                "identical_rounds": same,
                # 1-minute load average at the end of the workload, per round (each side)
                "load_average": [[p["load_average"], k["load_average"]] for p, k in pairs],
            }
            for extra in EXTRA:
                got = [
                    (r["plain"][name].get(figure), r[extra][name].get(figure))
                    for r in rounds
                    if extra in r
                ]
                got = [(p, x) for p, x in got if p and x is not None]
                if got:
                    row[extra] = statistics.median(x for _, x in got)
                    row[f"{extra}_ratio"] = statistics.median(x / p for p, x in got)
            if "tiered" in row:  # what the memory tier gives: ÷ the kvtier server, per round
                each = [
                    (r["tiered"][name][figure], r["kvtier"][name][figure])
                    for r in rounds
                    if "tiered" in r and r["kvtier"][name].get(figure)
                ]
                row["tiered_vs_kvtier_rounds"] = each  # (tiered, kvtier) per round
                row["tiered_vs_kvtier"] = statistics.median(t / k for t, k in each)
            rows.append(row)
        for counter in COUNTERS:
            row = {
                "workload": name,
                "measure": counter,
                "figure": counter,
                "plain": statistics.median(p.get(counter, 0) for p, _ in pairs),
                "kvtier": statistics.median(k.get(counter, 0) for _, k in pairs),
            }
            for extra in EXTRA:
                if any(extra in r for r in rounds):
                    row[extra] = statistics.median(
                        r[extra][name].get(counter, 0) for r in rounds if extra in r
                    )
            rows.append(row)
    return rows


def print_report(rows: list[dict], rounds: list[dict], reserved: int) -> None:
    print(
        f"vllm serve, kvtier vs no connector: {len(rounds)} rounds, fresh servers, "
        f"VLLM_CPU_NUM_OF_RESERVED_CPU={reserved} on both"
    )
    for r, entry in enumerate(rounds):
        p, k = entry["plain"], entry["kvtier"]
        print(
            f"  round {r}: no connector {p['binding']}; kvtier {k['binding']}; "
            f"load average {k.get('load_average_end', 0):.1f}; stop {p['stop_s']:.1f} s / "
            f"{k['stop_s']:.1f} s, left: {len(p['left']) + len(k['left'])}"
        )
        for extra, what in EXTRA.items():
            if extra in entry:
                print(f"  round {r}: {what} {entry[extra]['binding']}")
    shown = [x for x in EXTRA if any(x in row for row in rows)]
    header = f"{'workload':18} {'measure':30} {'no connector':>13} {'kvtier':>10} {'ratio':>7}"
    for extra in shown:
        header += f" {extra:>8} {extra + ' ratio':>12}"
    print(header)
    print("-" * len(header))
    for row in rows:
        if "ratio" in row:
            line = (
                f"{row['workload']:18} {row['measure']:30} {row['plain']:13.3f} "
                f"{row['kvtier']:10.3f} {row['ratio']:7.3f}"
            )
            for extra in shown:
                line += f" {row[extra]:8.3f} {row[extra + '_ratio']:12.3f}" if extra in row else ""
            print(line)
        else:
            line = (
                f"{row['workload']:18} {row['measure']:30} {row['plain']:13.0f} "
                f"{row['kvtier']:10.0f}"
            )
            line += f" {'':7}" if shown else ""
            for extra in shown:
                line += f" {row[extra]:8.0f} {'':12}" if extra in row else ""
            print(line)
    print_tiered(rows)
    for name in dict.fromkeys(r["workload"] for r in rows):
        same = next(r["identical_rounds"] for r in rows if r["workload"] == name and "ratio" in r)
        print(f"{name}: completions identical at temperature 0 in {same} of {len(rounds)} rounds")
        for r, entry in enumerate(rounds):
            plain = entry["plain"][name]
            for label in ("kvtier", *EXTRA):
                if label in entry and entry[label][name]["tokens"] != plain["tokens"]:
                    print(f"  round {r}, {label}: {differences(plain, entry[label][name])}")


def print_tiered(rows: list[dict]) -> None:
    """--tiered: the memory tier's server ÷ the kvtier server (store alone), round by round."""
    tiered = [row for row in rows if "tiered_vs_kvtier" in row]
    if tiered:
        print("memory tier in front ÷ store alone (--tiered ÷ kvtier): median, then per round")
    for row in tiered:
        scale, form = (1, ".2f") if row["figure"] == "requests_per_s" else (1000, ".0f")  # ms
        each = "  ".join(
            f"{t / k:.3f} ({t * scale:{form}}/{k * scale:{form}})"
            for t, k in row["tiered_vs_kvtier_rounds"]
        )
        print(f"  {row['workload']:18} {row['measure']:30} {row['tiered_vs_kvtier']:7.3f}   {each}")


def differences(plain: dict, other: dict) -> str:
    """Which requests' completions differ, where, and whether their prefix was seen before (a
    first-time request loads nothing: a difference there is the engine's own arithmetic)."""
    out = []
    for i, (a, b) in enumerate(zip(plain["tokens"], other["tokens"])):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append(f"#{i} at token {at} ({'seen' if other['seen'][i] else 'first time'})")
    return f"{len(out)} request(s) differ: " + ", ".join(out[:8])


def report(args: argparse.Namespace) -> int:
    plan = workloads(args)
    with ExitStack() as stack:
        args.cluster = None
        if args.mooncake_link:
            link = mooncake_behind_link(args.mooncake_link, args.segment_bytes)
            args.cluster = stack.enter_context(link)
        rounds = _rounds(args, plan)
    rows = rows_of(rounds, plan)
    if args.json:
        print_json_rows(rows)
    else:
        print_report(rows, rounds, reserved_cpus(args))
    if args.plot:
        save_plot(args.plot, lambda plt: _draw(plt, rows), "kvtier / no connector, vllm serve")
    return 0


def _rounds(args: argparse.Namespace, plan) -> list[dict]:
    from kvtier_bench.vllm_engine import model_or_built

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-serve-") as tmp:
        root = Path(tmp)
        model = model_or_built(args.model, root)
        rounds = []
        for run in range(args.rounds):
            entry = {}
            order = ["plain", "kvtier"] if run % 2 == 0 else ["kvtier", "plain"]
            for extra, wanted in (
                ("ideal", args.ideal),
                ("null", args.null_connector),
                ("tiered", args.tiered),
            ):
                if wanted:
                    order.insert(run % (len(order) + 1), extra)
            for label in order:
                progress(f"round {run + 1}/{args.rounds}: {label}")
                entry[label] = one_server(args, model, root, label, run, plan)
                entry[label]["load_average_end"] = os.getloadavg()[0]
            rounds.append(entry)
    return rounds


def _draw(plt, rows: list[dict]) -> None:
    shown = [r for r in rows if "ratio" in r]
    labels = [f"{r['workload']}\n{r['measure']}" for r in shown]
    plt.barh(range(len(shown)), [r["ratio"] for r in shown])
    plt.yticks(range(len(shown)), labels, fontsize=6)
    plt.axvline(1.0, color="k", lw=0.8)
    plt.xlabel("kvtier / no connector (median over rounds)")


def main() -> int:
    from kvtier_bench.common import standalone
    from kvtier_bench.options import serve_arguments

    return standalone("serve", __doc__, serve_arguments, report)


if __name__ == "__main__":
    raise SystemExit(main())
