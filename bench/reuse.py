"""Prefix reuse as vLLM's own client measures it: ``vllm bench serve --dataset-name
prefix_repetition`` against ``vllm serve`` with kvtier and without, at kvtier's defaults.

Each round starts a fresh server without a connector and a fresh one with kvtier (a new file
store, every setting at its default: load or recompute on, ``load_mode: auto``), one at a time,
in alternating order, on the same CPU reservation (``kvtier bench serve``'s fair binding), and
runs vLLM's benchmark client against each with the same seed: ``--prefixes`` prefixes of
``--prefix-tokens`` tokens, ``--repeats`` prompts each, shuffled, ``--concurrency`` in flight,
``--output-tokens`` each, vLLM's KV cache ``--kv-bytes`` (by default a third of the prefixes).

``--null-connector`` adds a server per round with a connector that does nothing
(``kvtier_bench.null_connector``): what vLLM's connector machinery costs alone.

Reported per round: TTFT mean, median, p90 and p99 of each server (vLLM's client's own figures
from its detailed result file) and kvtier ÷ no connector; then the tail two ways that are not one
event a round: the p99 over every round's requests pooled, and the p99 of each round after its
first burst (the first ``--concurrency`` requests, which start cold in both servers). The load
average is beside each server, and kvtier's counters (declined tokens, skipped lookups, loaded
tokens) and the decision's estimates (its gauges) as ``/metrics`` showed them at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvtier_bench.common import print_json_rows, progress
from kvtier_bench.reuse_s3 import s3_chain
from kvtier_bench.serve import NULL_CONNECTOR, binding, reserved_cpus
from kvtier_bench.vllm_server import Server

COUNTERS = {
    "loaded_tokens": "vllm:kvtier_loaded_tokens_total",
    "declined_tokens": "vllm:kvtier_declined_tokens_total",
    "lookups_skipped": "vllm:kvtier_lookups_skipped_total",
    "in_step_loaded_tokens": "vllm:kvtier_in_step_loaded_tokens_total",
    "external_hit_tokens": "vllm:external_prefix_cache_hits_total",
}
CLIENT_TIMEOUT_S = 1800.0


def client_command(args: argparse.Namespace, server: Server, result: Path, seed: int) -> list:
    return [
        sys.executable, "-m", "kvtier.vllm", "bench", "serve",
        "--backend", "vllm",
        "--base-url", server.url,
        "--endpoint", "/v1/completions",
        "--model", server.model,
        "--tokenizer", server.model,
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.prefix_tokens),
        "--prefix-repetition-suffix-len", str(args.suffix_tokens),
        "--prefix-repetition-num-prefixes", str(args.prefixes),
        "--prefix-repetition-output-len", str(args.output_tokens),
        "--num-prompts", str(args.prefixes * args.repeats),
        "--max-concurrency", str(args.concurrency),
        "--ignore-eos",
        "--temperature", "0",  # greedy: the two servers' completions must be the same
        "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot",
        "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed",
        "--result-dir", str(result.parent),
        "--result-filename", result.name,
    ]  # fmt: skip


def one_server(args, model: str, root: Path, label: str, run: int) -> dict[str, Any]:
    """A fresh server (``plain``, ``kvtier`` or ``null``) through one run of vLLM's client."""
    if label == "kvtier" and args.s3_outage:
        with s3_chain(root / f"s3-{run}", args.s3_outage) as (storage, outage):
            extra = {"storage": storage, **json.loads(args.kvtier_settings)}
            out = _one_server(args, model, root, label, run, extra, outage["start"])
        return {**out, **outage["happened"]}
    extra = None
    if label == "kvtier":
        storage: dict[str, Any] = {"backend": "file", "root": str(root / f"store{run}")}
        if args.store_faults:
            storage["faults"] = json.loads(args.store_faults)
        extra = {"storage": storage, **json.loads(args.kvtier_settings)}
    return _one_server(args, model, root, label, run, extra)


def _one_server(args, model, root, label, run, extra, on_client_start=None) -> dict[str, Any]:
    server = Server(
        model,
        root / f"{label}{run}",
        kvtier=extra,
        connector=NULL_CONNECTOR if label == "null" else None,
        kv_bytes=args.kv_bytes,
        max_model_len=args.prefix_tokens + args.suffix_tokens + args.output_tokens + 64,
        max_num_seqs=max(8, args.concurrency),
        reserved_cpus=reserved_cpus(args),
        tokenizer=True,
    )
    out: dict[str, Any] = {"server": label, "round": run + 1}
    try:
        server.start()
        out["ready_s"] = round(server.wait_ready(), 1)
        out["binding"] = binding(server)
        # Warm-up: one long prompt of unrelated tokens, so that neither server's first burst
        # pays its process's first long prefill (kernel and memory first use): the tail is the
        # workload's, not the server's start (the p99 after the first burst is shown too).
        server.complete(" ".join(["af ag ah ai"] * (args.prefix_tokens // 4)), 2)
        server.reset_prefix_cache()
        if on_client_start is not None:
            on_client_start()
        out.update(measure(args, server, root / f"{label}{run}.json", run))
        out["stop_s"] = server.stop()
        ttfts = out["ttfts"]
        progress(
            f"  {label}: TTFT mean {statistics.fmean(ttfts):.3f} s, "
            f"p99 {percentile(ttfts, 99):.3f} s; loaded {out['loaded_tokens']:.0f}, "
            f"declined {out['declined_tokens']:.0f}, "
            f"skipped lookups {out['lookups_skipped']:.0f}; load {out['load_average']}"
        )
    finally:
        if server.process is not None and server.process.poll() is None:
            server.stop("group", 9)
        server.kill_marked()
    return out


def measure(args: argparse.Namespace, server: Server, result: Path, run: int) -> dict[str, Any]:
    """vLLM's client against ``server`` (its detailed result in ``result``): each request's
    TTFT in the order sent, the completions, kvtier's counters and estimates, the load."""
    before = server.metrics()
    done = subprocess.run(
        client_command(args, server, result, seed=run),
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
    )
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    after = server.metrics()
    data = json.loads(result.read_text())
    if data["failed"]:
        errors = [e for e in data["errors"] if e]
        raise RuntimeError(f"{data['failed']} requests failed, e.g.: {errors[0][:500]}")
    sent = sorted(zip(data["start_times"], data["ttfts"]))  # the first burst first
    out: dict[str, Any] = {
        "load_average": round(os.getloadavg()[0], 2),
        "ttfts": [ttft for _, ttft in sent if ttft],
        "failed": data["failed"],
        "completed": data["completed"],
        "generated": data.get("generated_texts", []),
        "estimates": estimates(server),
    }
    for name, metric in COUNTERS.items():
        out[name] = after.get(metric, 0) - before.get(metric, 0)
    return out


def estimates(server: Server) -> dict[str, float]:
    """The decision's gauges on the server's ``/metrics``: ``{what}`` or ``tier<N>_{what}``."""
    import re
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("vllm:kvtier_estimate_seconds{"):
            labels, _, value = line.rpartition(" ")
            what = re.search(r'what="([^"]*)"', labels)
            tier = re.search(r'tier="([^"]*)"', labels)
            if what:
                name = (
                    f"tier{tier.group(1)}_{what.group(1)}"
                    if tier and tier.group(1)
                    else what.group(1)
                )
                out[name] = float(value)
    return out


def percentile(values: list[float], q: float) -> float:
    """vLLM's client's own: numpy's linear interpolation."""
    import numpy as np

    return float(np.percentile(values, q)) if values else float("nan")


def figures(ttfts: list[float], first_burst: int) -> dict[str, float]:
    later = ttfts[first_burst:]
    return {
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_p99_after_first_burst_s": percentile(later, 99),
    }


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def _null(r: dict[str, dict], burst: int) -> dict[str, Any]:
    """The null connector's figures and ratio to no connector, where it ran."""
    if "null" not in r:
        return {}
    plain, null = figures(r["plain"]["ttfts"], burst), figures(r["null"]["ttfts"], burst)
    return {
        **{f"null_ratio_{k}": _ratio(null[k], plain[k]) for k in plain},
        "null_ttfts_ms": [round(t * 1e3) for t in r["null"]["ttfts"]],
    }


def rows_of(rounds: list[dict[str, dict]], burst: int) -> list[dict[str, Any]]:
    rows = []
    for r in rounds:
        plain, kvtier = figures(r["plain"]["ttfts"], burst), figures(r["kvtier"]["ttfts"], burst)
        rows.append(
            {
                "round": r["plain"]["round"],
                **{f"plain_{k}": round(v, 4) for k, v in plain.items()},
                **{f"kvtier_{k}": round(v, 4) for k, v in kvtier.items()},
                **{f"ratio_{k}": _ratio(kvtier[k], plain[k]) for k in plain},
                "same_completions": r["plain"]["generated"] == r["kvtier"]["generated"],
                "load_average": [r["plain"]["load_average"], r["kvtier"]["load_average"]],
                **{k: r["kvtier"][k] for k in COUNTERS},
                "estimates": r["kvtier"]["estimates"],
                # each request's TTFT (ms) in the order sent, the same prompts in both servers
                "plain_ttfts_ms": [round(t * 1e3) for t in r["plain"]["ttfts"]],
                "kvtier_ttfts_ms": [round(t * 1e3) for t in r["kvtier"]["ttfts"]],
                **_null(r, burst),
                **{k: v for k, v in r["kvtier"].items() if k.startswith("s3_")},
            }
        )
    pooled = {
        s: figures([t for r in rounds for t in r[s]["ttfts"]], 0) for s in ("plain", "kvtier")
    }
    rows.append(
        {
            "round": "pooled",
            "ratio_ttft_p99_s": round(
                pooled["kvtier"]["ttft_p99_s"] / pooled["plain"]["ttft_p99_s"], 3
            ),
            "ratio_ttft_mean_s": round(
                pooled["kvtier"]["ttft_mean_s"] / pooled["plain"]["ttft_mean_s"], 3
            ),
            "ratio_ttft_p50_s": round(
                pooled["kvtier"]["ttft_p50_s"] / pooled["plain"]["ttft_p50_s"], 3
            ),
        }
    )
    return rows


def print_report(rows: list[dict[str, Any]]) -> None:
    shown = [
        "ttft_mean_s",
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "ttft_p99_after_first_burst_s",
    ]
    print(f"{'round':<7} {'measure':<30} {'no connector':>12} {'kvtier':>9} {'ratio':>7}  load")
    for row in rows:
        if row["round"] == "pooled":
            continue
        for k in shown:
            print(
                f"{row['round']:<7} {k:<30} {row['plain_' + k]:>12.3f} {row['kvtier_' + k]:>9.3f} "
                f"{row['ratio_' + k]:>7.3f}  {row['load_average']}"
            )
        print(
            f"{'':<7} kvtier: loaded {row['loaded_tokens']:.0f}, declined "
            f"{row['declined_tokens']:.0f}, skipped lookups {row['lookups_skipped']:.0f}, "
            f"same completions: {row['same_completions']}"
        )
        print(f"{'':<7} estimates: {row['estimates']}")
        if "s3_restarted" in row:
            print(
                f"{'':<7} S3 killed mid-run (objects then: {row.get('s3_objects_at_kill')}), "
                f"restarted: {row['s3_restarted']}, objects at the end: "
                f"{row.get('s3_objects_at_end')}"
            )
        if "null_ratio_ttft_p99_s" in row:
            print(
                f"{'':<7} null connector / no connector: TTFT mean "
                f"{row['null_ratio_ttft_mean_s']}, p99 {row['null_ratio_ttft_p99_s']}"
            )
    pooled = rows[-1]
    print(
        f"pooled over rounds: TTFT p99 ratio {pooled['ratio_ttft_p99_s']}, mean "
        f"{pooled['ratio_ttft_mean_s']}, p50 {pooled['ratio_ttft_p50_s']}"
    )


def report(args: argparse.Namespace) -> int:
    from kvtier_bench.vllm_engine import model_or_built

    with tempfile.TemporaryDirectory(prefix="kvtier-bench-reuse-") as tmp:
        root = Path(tmp)
        model = model_or_built(args.model, root)
        rounds = []
        for run in range(args.rounds):
            order = ["plain", "kvtier"] if run % 2 == 0 else ["kvtier", "plain"]
            if args.null_connector:
                order.insert(run % 3, "null")
            entry = {}
            for label in order:
                progress(f"round {run + 1}/{args.rounds}: {label}")
                entry[label] = one_server(args, model, root, label, run)
            rounds.append(entry)
    rows = rows_of(rounds, args.concurrency)
    if args.json:
        print_json_rows(rows)
    else:
        print_report(rows)
    return 0
