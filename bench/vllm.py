"""`kvtier bench vllm`: one prompt set served three ways by a real vLLM engine (CPU).

(a) vLLM alone: every run recomputes the prefill; (b) vLLM + kvtier, first run: a miss, the
KV computed and saved (saves run off the critical path); (c) vLLM + kvtier after
``reset_prefix_cache()``: every cached token is loaded from kvtier. Each is repeated (medians,
min-max beside them) and compared with (a). kvtier's load bandwidth through its worker is shown
beside what `kvtier bench storage` measures for a warm file-store load of the same object size.
Engines run one at a time, each in its own process, on a random Llama built here (no download).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

from kvtier_bench.common import emit, progress, standalone
from kvtier_bench.options import vllm_arguments as add_arguments

COLUMNS = [
    ("configuration", "configuration", "s"),
    ("prompts", "prompts", "d"),
    ("prompt_tokens", "prompt tokens", "d"),
    ("external_hit_tokens", "kvtier hit tokens", "d"),
    ("wall_s", "wall s (median)", ".3f"),
    ("spread", "min-max", "s"),
    ("ratio_to_recompute", "x recompute", ".3f"),
    ("load_mib", "loaded MiB", ".1f"),
    ("load_gbps", "load GB/s", ".2f"),
]
RUNNER = "kvtier_bench.vllm_engine"


def _runner(*argv: str, timeout_s: float = 3600) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-m", RUNNER, *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "VLLM_HOST_IP": "127.0.0.1"},
    )
    if out.returncode != 0:
        raise RuntimeError(f"vLLM engine failed:\n{(out.stdout + out.stderr)[-3000:]}")
    marker = "KVTIER-RUN "
    return [
        json.loads(line[len(marker) :])
        for line in out.stdout.splitlines()
        if line.startswith(marker)
    ]


def run(args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as tmp:
        model = args.model or str(Path(tmp) / "model")
        if not args.model:
            progress(f"building a random Llama (hidden {args.hidden}) in {model}")
            _runner("make-model", model, "--hidden", str(args.hidden))
        common = {
            "model": model,
            "prompts": args.prompts,
            "tokens": args.prompt_tokens,
            "shared": args.shared_tokens,
            "reps": args.reps,
        }
        progress(f"vLLM alone: {args.reps} runs of {args.prompts} x {args.prompt_tokens} tokens")
        alone = _runner("run", json.dumps({**common, "kvtier": False}))
        store = args.store or str(Path(tmp) / "store")
        progress("vLLM + kvtier: a first run (miss + save) and a hit run, each repetition")
        kv = _runner(
            "run",
            json.dumps(
                {
                    **common,
                    "kvtier": True,
                    "storage": {"backend": "file", "root": store},
                    "instance": f"bench{uuid.uuid4().hex[:8]}",
                    "load_mode": args.load_mode,
                }
            ),
        )
    rows = _rows(args, alone + kv)
    if not args.no_storage_reference:
        rows.append(_storage_reference(rows))
    return rows


def _rows(args: argparse.Namespace, records: list[dict]) -> list[dict]:
    by_config: dict[str, list[dict]] = {}
    for r in records:
        by_config.setdefault(r["configuration"], []).append(r)
    reference_tokens = next(iter(by_config.values()))[0]["tokens"]
    base = statistics.median(r["wall_s"] for r in next(iter(by_config.values())))
    rows = []
    for config, runs in by_config.items():
        walls = [r["wall_s"] for r in runs]
        load_bytes = sum(r.get("kvtier_load_bytes", 0) for r in runs)
        load_s = sum(r.get("kvtier_load_microseconds", 0) for r in runs) / 1e6
        rows.append(
            {
                "configuration": config,
                "prompts": args.prompts,
                "prompt_tokens": args.prompts * args.prompt_tokens,
                "external_hit_tokens": int(
                    statistics.median(r.get("external_prefix_cache_hits", 0) for r in runs)
                ),
                "wall_s": statistics.median(walls),
                "spread": f"{min(walls):.3f}-{max(walls):.3f}",
                "ratio_to_recompute": statistics.median(walls) / base,
                "load_mib": load_bytes / len(runs) / 2**20,
                "load_gbps": load_bytes / load_s / 1e9 if load_s else 0.0,
                "tokens_match": all(r["tokens"] == reference_tokens for r in runs),
                "runs": len(runs),
            }
        )
    return rows


def _storage_reference(rows: list[dict]) -> dict:
    """`kvtier bench storage`'s warm file-store load of 1 MiB objects (the bench model's
    block size: 4 layers x K|V x 4 heads x 128 tokens x 64 x fp32), measured now."""
    from kvtier_bench import storage

    progress("reference: kvtier bench storage --backends file --sizes 1 (warm load)")
    parser = argparse.ArgumentParser()
    storage.add_arguments(parser)
    srows = storage.run(parser.parse_args(["--backends", "file", "--sizes", "1", "--runs", "5"]))
    warm = next(r for r in srows if r["op"] == "load_warm")
    hits = rows[-1]
    return {
        "configuration": "kvtier bench storage: file load_warm, 1 MiB objects",
        "prompts": 0,
        "prompt_tokens": 0,
        "external_hit_tokens": 0,
        "wall_s": 0.0,
        "spread": "-",
        "ratio_to_recompute": hits["load_gbps"] / warm["gbps"] if warm["gbps"] else 0.0,
        "load_mib": 0.0,
        "load_gbps": warm["gbps"],
        "tokens_match": True,
        "runs": 5,
    }


def demo(prompts: int = 8, tokens: int = 1024, shared: int = 768, as_json: bool = False) -> int:
    """`kvtier demo --engine vllm`: a shared-prefix workload through a real vLLM engine, once
    alone and once with kvtier (a first run that saves, then after reset_prefix_cache())."""
    args = argparse.Namespace(
        prompts=prompts,
        prompt_tokens=tokens,
        shared_tokens=shared,
        reps=1,
        hidden=512,
        model=None,
        store=None,
        no_storage_reference=True,
        load_mode="auto",
        json=as_json,
    )
    rows = run(args)
    if as_json:
        print(json.dumps(rows))
        return 0 if all(r["tokens_match"] for r in rows) else 1
    alone, first, hits = rows
    print(
        f"\n{prompts} prompts x {tokens} tokens ({shared} shared), a random Llama on vLLM "
        f"{_vllm_version()} (CPU)"
    )
    print(f"  {'run':<44}{'kvtier hit tokens':>18}{'time s':>9}")
    for row in rows:
        print(f"  {row['configuration']:<44}{row['external_hit_tokens']:>18,}{row['wall_s']:>9.2f}")
    match = all(r["tokens_match"] for r in rows)
    print(
        f"  with kvtier hits: {hits['ratio_to_recompute']:.2f} x the time of vLLM alone; "
        f"output {'identical to' if match else 'DIFFERENT from'} vLLM alone"
    )
    return 0 if match else 1


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def report(args: argparse.Namespace) -> int:
    rows = run(args)
    emit(rows, args.json, "kvtier bench vllm (wall time of llm.generate, max_tokens=1)", COLUMNS)
    if not args.json:
        hits = rows[2]
        first = rows[1]
        print(
            f"hits: {hits['ratio_to_recompute']:.3f} x recompute; first run with saves: "
            f"{first['ratio_to_recompute']:.3f} x; outputs identical: "
            f"{all(r['tokens_match'] for r in rows)}"
        )
        if len(rows) > 3:
            print(
                f"load through the worker {hits['load_gbps']:.2f} GB/s = "
                f"{rows[3]['ratio_to_recompute']:.2f} x the warm file-store load "
                f"({rows[3]['load_gbps']:.2f} GB/s); (last row: 'x recompute' is that ratio)"
            )
    return 0 if all(r["tokens_match"] for r in rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    return standalone("vllm", __doc__, add_arguments, report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
