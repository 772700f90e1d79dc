"""Real traffic: a Mooncake-format request trace replayed against `vllm serve` with and without
kvtier, on the fair binding of `kvtier bench serve` (fresh servers, alternating order).

A trace line is ``{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}``
(Mooncake's FAST'25 traces, AIPerf's ``mooncake_trace``, vLLM's ``timed_trace``): each hash id
is one block of the prompt, the same id the same tokens. Scaled to the machine: a window of
``--requests`` lines from ``--start``, ``--block-tokens`` tokens per hash id (the trace's are
512), at most ``--max-prompt-tokens`` and ``--max-output-tokens``, arrival times stretched by
``--time-scale``. Requests are sent when their time comes (open loop, at most
``--max-in-flight`` at once), whatever is still running.

Beside the servers' figures the window's ideal prefix hits are printed: the tokens of each
prompt's leading blocks already seen (an infinite cache), and already in an LRU cache of
``--capacity-blocks`` blocks (the store's size, when bounded). The trace file is only read:
regular files only, one line at most ``MAX_LINE_BYTES``, the fields checked.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import stat
import statistics
import tempfile
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier_bench import serve_load as load
from kvtier_bench.common import print_json_rows, progress
from kvtier_bench.serve import COUNTERS, binding, reserved_cpus
from kvtier_bench.vllm_server import Server

MAX_LINE_BYTES = 1 << 20  # a line of 100k hash ids; a longer one is not a trace line
# Read before the window ends: Mooncake's traces are a few MB; a gzip bomb stops here.
MAX_TRACE_BYTES = 256 << 20
MAX_NESTING = 4  # a trace line is one object holding one list: "[" and "{" counted, no deeper
TRACE_BLOCK_TOKENS = 512  # what one hash id stands for in Mooncake's traces


@dataclass(frozen=True)
class Request:
    at_s: float  # when to send it, from the window's start (scaled)
    hash_ids: tuple[int, ...]
    prompt: list[int]
    output: int


def checkout_trace() -> str:
    """The trace beside a checkout (``../shared/traces``): a ConfigError where there is none,
    as in an installed package."""
    path = Path(__file__).resolve().parents[2] / "shared/traces/synthetic_trace.jsonl.gz"
    if not path.is_file():
        raise ConfigError(
            "--trace",
            "give a trace file: none lies beside this install (a checkout finds "
            "../shared/traces/synthetic_trace.jsonl.gz; Mooncake's FAST'25 traces have this "
            "format: JSON lines of timestamp, input_length, output_length, hash_ids)",
        )
    return str(path)


def read_trace(path: str, start: int, lines: int, every: int = 1) -> list[dict[str, Any]]:
    """The lines ``start`` .. ``start + lines`` of the trace at ``path`` (JSON lines, gzip or
    not) whose first hash id is a multiple of ``every``: whole prefix groups, one in
    ``every``, so their reuse is kept (thinning lines instead loses it: reuse is long-range)."""
    try:  # never blocks on a FIFO; what is open is checked before a byte is read
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError("--trace", f"cannot open {path}: {e.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ConfigError("--trace", f"{path} is not a regular file")
    kept, read = [], 0
    with os.fdopen(fd, "rb") as raw, gzip.open(raw) if path.endswith(".gz") else raw as stream:
        for n, line in enumerate(iter(lambda: stream.readline(MAX_LINE_BYTES + 1), b"")):
            if len(line) > MAX_LINE_BYTES:
                raise ConfigError("--trace", f"{path}:{n + 1}: a line over {MAX_LINE_BYTES} bytes")
            if n >= start + lines:
                break
            read += len(line)
            if read > MAX_TRACE_BYTES:
                raise ConfigError(
                    "--trace", f"{path}: over {MAX_TRACE_BYTES} bytes before line {start + lines}"
                )
            if n >= start:
                entry = _checked(line, f"{path}:{n + 1}")
                if entry["hash_ids"] and entry["hash_ids"][0] % every == 0:
                    kept.append(entry)
    return kept


def _checked(line: bytes, where: str) -> dict[str, Any]:
    if line.count(b"[") + line.count(b"{") > MAX_NESTING:  # json.loads recurses per level
        raise ConfigError("--trace", f"{where}: not a trace line (nested deeper than one list)")
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        raise ConfigError("--trace", f"{where}: not JSON") from None
    ok = (
        isinstance(entry, dict)
        and isinstance(entry.get("timestamp"), (int, float))
        and isinstance(entry.get("output_length"), int)
        and isinstance(entry.get("hash_ids"), list)
        and all(isinstance(h, int) for h in entry["hash_ids"])
    )
    if not ok:
        raise ConfigError(
            "--trace", f"{where}: not a trace line (timestamp, output_length, hash_ids)"
        )
    return entry


def requests_of(lines: list[dict], args: argparse.Namespace) -> list[Request]:
    t0 = lines[0]["timestamp"] if lines else 0
    blocks = max(1, args.max_prompt_tokens // args.block_tokens)
    out = []
    for line in lines:
        ids = tuple(line["hash_ids"][:blocks])
        prompt = [t for h in ids for t in load._tokens(1_000_003 + h, args.block_tokens)]
        output = max(1, min(line["output_length"], args.max_output_tokens))
        out.append(Request((line["timestamp"] - t0) / 1000 * args.time_scale, ids, prompt, output))
    return out


def ideal_hits(requests: list[Request], block_tokens: int, capacity: int | None) -> int:
    """Prompt tokens whose leading blocks were seen before (``capacity`` blocks, LRU; None:
    every block ever seen), as many as an engine can take from a cache. A block is known by its
    whole prefix, as an engine's chained block hashes know it: the same hash id after another
    prefix is another block."""
    cache: OrderedDict[tuple[int, ...], None] = OrderedDict()
    hit = 0
    for r in requests:
        chain = [r.hash_ids[: i + 1] for i in range(len(r.hash_ids))]
        lead = next((i for i, c in enumerate(chain) if c not in cache), len(chain))
        # an engine computes a prompt's last token whatever it holds: a prompt of whole
        # blocks hits one block fewer (with --block-tokens = the engine's block size)
        hit += block_tokens * min(lead, (len(r.prompt) - 1) // block_tokens)
        for c in chain:
            cache[c] = None
            cache.move_to_end(c)
        while capacity is not None and len(cache) > capacity:
            cache.popitem(last=False)
    return hit


def replay(server: Server, requests: list[Request], in_flight: int) -> list[load.Record]:
    """Each request sent at its time, or as soon as one of ``in_flight`` slots is free; its
    TTFT counts from its time in the trace, so that a wait for a slot is in it (a user's
    request does not wait less because the server was busy)."""
    start = time.perf_counter()
    slots = threading.Semaphore(in_flight)

    def one(r: Request) -> load.Record:
        try:
            record = load.stream(server, r.prompt, r.output, "trace", False)
        finally:
            slots.release()
        first_token_at = record.start + record.ttft_s
        return dataclasses.replace(record, ttft_s=first_token_at - (start + r.at_s))

    with ThreadPoolExecutor(in_flight) as pool:
        futures = []
        for r in requests:
            time.sleep(max(0.0, r.at_s - (time.perf_counter() - start)))
            slots.acquire()
            futures.append(pool.submit(one, r))
        return [f.result() for f in futures]


def one_server(args, model: str, root: Path, label: str, run: int, requests) -> dict[str, Any]:
    extra = None
    if label == "kvtier":
        storage: dict[str, Any] = {"backend": "file", "root": str(root / f"store{run}")}
        if args.capacity_blocks:
            storage["capacity_bytes"] = args.capacity_blocks * args.object_bytes
        extra = {**json.loads(args.kvtier_settings), "storage": storage}
    server = Server(
        model,
        root / f"{label}{run}",
        kvtier=extra,
        kv_bytes=args.kv_bytes,
        max_num_seqs=args.max_in_flight,
        reserved_cpus=reserved_cpus(args),
    )
    try:
        server.start()
        out: dict[str, Any] = {"ready_s": server.wait_ready(), "binding": binding(server)}
        server.complete([5, 6, 7, 8], 2)  # warm-up, unrelated to the trace
        before = server.metrics()
        records = replay(server, requests, args.max_in_flight)
        after = server.metrics()
        out.update(load.figures(records))
        out.update({k: after.get(v, 0) - before.get(v, 0) for k, v in COUNTERS.items()})
        out["tokens"] = [r.tokens for r in records]
        out["load_average"] = os.getloadavg()[0]
        out["stop_s"] = server.stop()
        out["left"] = server.leftovers()
        return out
    finally:
        if server.process is not None and server.process.poll() is None:
            server.stop("group", 9)
        server.kill_marked()


SHOWN = [
    ("ttft_mean_s", "TTFT mean (s)", "<= 0.8"),
    ("ttft_p50_s", "TTFT p50 (s)", ""),
    ("ttft_p99_s", "TTFT p99 (s)", "<= 1.0"),
    ("requests_per_s", "requests/s", ""),
    ("tpot_mean_s", "TPOT mean (s)", ""),
]


def rows_of(rounds: list[dict], ideal: dict[str, int], prompt_tokens: int) -> list[dict]:
    rows = []
    for figure, label, goal in SHOWN:
        pairs = [(r["plain"][figure], r["kvtier"][figure]) for r in rounds if r["plain"][figure]]
        rows.append(
            {
                "measure": label,
                "plain": statistics.median(p for p, _ in pairs),
                "kvtier": statistics.median(k for _, k in pairs),
                "ratio": statistics.median(k / p for p, k in pairs),
                "goal": goal,
            }
        )
    for label in ("plain", "kvtier"):
        hits = statistics.median(
            r[label]["vllm_hit_tokens"] + r[label]["external_hit_tokens"] for r in rounds
        )
        loaded = statistics.median(r[label]["kvtier_loaded_tokens"] for r in rounds)
        rows.append(
            {
                "measure": f"{label}: prefix hit tokens (vLLM's + kvtier's)",
                "value": hits,
                "of_prompt_tokens": hits / prompt_tokens,
                "of_ideal_unbounded": hits / ideal["infinite"] if ideal["infinite"] else None,
                "of_ideal_lru": hits / ideal["lru"] if ideal["lru"] else None,
                "kvtier_loaded_tokens": loaded,
            }
        )
    return rows


def report(args: argparse.Namespace) -> int:
    from kvtier_bench.vllm_engine import model_or_built

    args.trace = args.trace or checkout_trace()
    requests = requests_of(read_trace(args.trace, args.start, args.lines, args.every), args)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    capacity = args.capacity_blocks or None
    ideal = {
        "infinite": ideal_hits(requests, args.block_tokens, None),
        "lru": ideal_hits(requests, args.block_tokens, capacity),
    }
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-trace-") as tmp:
        root = Path(tmp)
        model = model_or_built(args.model, root)
        # an object: the random Llama's 8 KiB per token of a 128-token vLLM block, header, key
        args.object_bytes = 128 * 8 * 1024 + 4096
        rounds = []
        for run in range(args.rounds):
            entry = {}
            for label in ["plain", "kvtier"] if run % 2 == 0 else ["kvtier", "plain"]:
                progress(f"round {run + 1}/{args.rounds}: {label} ({len(requests)} requests)")
                entry[label] = one_server(args, model, root, label, run, requests)
            rounds.append(entry)
    rows = rows_of(rounds, ideal, prompt_tokens)
    if args.json:
        print_json_rows(rows)
    else:
        print_report(args, requests, ideal, rounds, rows)
    return 0


def print_report(args, requests: list[Request], ideal: dict, rounds: list, rows: list) -> None:
    prompt_tokens = sum(len(r.prompt) for r in requests)
    capacity = args.capacity_blocks or None
    same = sum(r["plain"]["tokens"] == r["kvtier"]["tokens"] for r in rounds)
    span = requests[-1].at_s if requests else 0.0
    print(
        f"trace {args.trace}: {len(requests)} requests of lines {args.start}.."
        f"{args.start + args.lines}, prefix groups one in {args.every}, "
        f"{prompt_tokens} prompt tokens over {span:.0f} s (x{args.time_scale} time), "
        f"{args.block_tokens} tokens per hash id"
    )
    lru = f"LRU of {capacity} blocks" if capacity else "LRU (unbounded)"
    print(
        f"ideal prefix hit tokens: infinite cache {ideal['infinite']} "
        f"({ideal['infinite'] / prompt_tokens:.1%}); {lru} {ideal['lru']}"
    )
    for r, entry in enumerate(rounds):
        print(
            f"  round {r}: load average {entry['kvtier']['load_average']:.1f} / "
            f"{entry['plain']['load_average']:.1f}; left {len(entry['kvtier']['left'])}"
        )
    print(f"{'measure':48} {'no connector':>13} {'kvtier':>10} {'ratio':>7}  goal")
    for row in rows:
        if "ratio" in row:
            print(
                f"{row['measure']:48} {row['plain']:13.3f} {row['kvtier']:10.3f} "
                f"{row['ratio']:7.3f}  {row['goal']}"
            )
        else:
            shares = f"{row['of_ideal_unbounded'] or 0:.2f} x ideal (unbounded)"
            if capacity:
                shares += f", {row['of_ideal_lru'] or 0:.2f} x ideal (LRU of {capacity} blocks)"
            print(
                f"{row['measure']:48} {row['value']:13.0f} = {row['of_prompt_tokens']:.1%} of "
                f"prompt tokens, {shares}; kvtier loaded {row['kvtier_loaded_tokens']:.0f}"
            )
    print(f"completions identical at temperature 0 in {same} of {len(rounds)} rounds")


def main() -> int:
    from kvtier_bench.common import standalone
    from kvtier_bench.options import trace_arguments

    return standalone("trace", __doc__, trace_arguments, report)


if __name__ == "__main__":
    raise SystemExit(main())
