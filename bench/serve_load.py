"""The client side of ``kvtier bench serve``: workloads, a streaming OpenAI client, figures.

Requests are OpenAI completions with token-id prompts, streamed, as ``vllm bench serve`` sends
them (random-weight models have no tokenizer): TTFT is the time to the first streamed token,
TPOT the time per later token. A workload is a list of sessions; a session's turns run in
order, each prompt being the earlier turns, their answers and the new turn (a chat), and up to
``concurrency`` sessions run at once. A request is "seen" when its prefix (its group) was
answered before it was sent: the requests a prefix cache can serve.
"""

from __future__ import annotations

import http.client
import json
import random
import statistics
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

REQUEST_TIMEOUT_S = 900.0  # one streamed completion of a few thousand tokens, busy machine


@dataclass
class Session:
    group: str  # requests of one group share a prefix
    turns: list[list[int]]  # the new tokens of each turn


@dataclass
class Record:
    group: str
    seen: bool
    prompt_tokens: int
    ttft_s: float
    tpot_s: float
    start: float
    end: float
    tokens: list[int] = field(default_factory=list)


def _tokens(seed: int, n: int) -> list[int]:
    """``n`` pseudo-random token ids in 10..1009 from ``seed`` (no two seeds share a block)."""
    rng = random.Random(seed)
    return [rng.randrange(10, 1010) for _ in range(n)]


def prefix_reuse(
    tag: int, prefixes: int, prefix_tokens: int, repeats: int, suffix_tokens: int
) -> list[Session]:
    """``repeats`` rounds over ``prefixes`` long prefixes, each request a new suffix: with a
    working set larger than vLLM's cache, each prefix is evicted before it comes back."""
    heads = [_tokens(tag * 1000 + p, prefix_tokens) for p in range(prefixes)]
    return [
        Session(f"p{p}", [heads[p] + _tokens(tag * 1000 + 500 + r * prefixes + p, suffix_tokens)])
        for r in range(repeats)
        for p in range(prefixes)
    ]


def no_reuse(tag: int, prompts: int, prompt_tokens: int) -> list[Session]:
    return [Session(f"u{i}", [_tokens(tag * 1000 + i, prompt_tokens)]) for i in range(prompts)]


def chat(tag: int, users: int, turns: int, first_tokens: int, turn_tokens: int) -> list[Session]:
    return [
        Session(
            f"user{u}",
            [_tokens(tag * 1000 + u, first_tokens)]
            + [_tokens(tag * 1000 + 100 + u * turns + k, turn_tokens) for k in range(1, turns)],
        )
        for u in range(users)
    ]


def run(server: Any, sessions: Sequence[Session], concurrency: int, output: int) -> list[Record]:
    """Every session through ``server`` (a ``vllm_server.Server``), ``concurrency`` at once."""
    answered: set[str] = set()
    lock = threading.Lock()

    def one(session: Session) -> list[Record]:
        history: list[int] = []
        records = []
        for turn in session.turns:
            prompt = history + turn
            with lock:
                seen = session.group in answered
            record = stream(server, prompt, output, session.group, seen)
            with lock:
                answered.add(session.group)
            history = prompt + record.tokens
            records.append(record)
        return records

    with ThreadPoolExecutor(concurrency) as pool:
        return [r for records in pool.map(one, sessions) for r in records]


def stream(server: Any, prompt: list[int], output: int, group: str, seen: bool) -> Record:
    body = {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": output,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    conn = http.client.HTTPConnection(server.host, server.port, timeout=REQUEST_TIMEOUT_S)
    tokens: list[int] = []
    first = None
    start = time.perf_counter()
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        for line in response:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            ids = json.loads(data)["choices"][0].get("token_ids") or []
            if ids and first is None:
                first = time.perf_counter()
            tokens.extend(ids)
    finally:
        conn.close()
    end = time.perf_counter()
    first = first or end
    tpot = (end - first) / (len(tokens) - 1) if len(tokens) > 1 else 0.0
    return Record(group, seen, len(prompt), first - start, tpot, start, end, tokens)


def figures(records: Sequence[Record]) -> dict[str, float]:
    """TTFT mean/p50/p90/p99 of all requests and of the seen ones, TPOT, requests/s."""
    if not records:
        return {}
    wall = max(r.end for r in records) - min(r.start for r in records)
    out = {"requests": len(records), "requests_per_s": len(records) / wall, "wall_s": wall}
    out.update(_ttft("ttft", [r.ttft_s for r in records]))
    out.update(_ttft("seen_ttft", [r.ttft_s for r in records if r.seen]))
    out["tpot_mean_s"] = statistics.fmean(r.tpot_s for r in records)
    return out


def _ttft(name: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    values = sorted(values)
    return {
        f"{name}_mean_s": statistics.fmean(values),
        f"{name}_p50_s": percentile(values, 50),
        f"{name}_p90_s": percentile(values, 90),
        f"{name}_p99_s": percentile(values, 99),
    }


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    k = (len(sorted_values) - 1) * q / 100
    low = int(k)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (k - low)
