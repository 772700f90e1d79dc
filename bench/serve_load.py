"""The client side of ``kvtier bench serve``: workloads, a streaming OpenAI client, figures.

Requests are OpenAI completions with token-id prompts, streamed, as ``vllm bench serve`` sends
them (random-weight models have no tokenizer): TTFT is the time to the first streamed token,
TPOT the time per later token. A workload is a list of sessions; a session's turns run in
order, each prompt being the earlier turns, their answers and the new turn (a chat); up to
``concurrency`` requests run at once, and a session's next turn queues behind the turns already
waiting (other users are served while one reads and types). A request is "seen" when its
prefix (its group) was answered before it was sent: the requests a prefix cache can serve.
"""

from __future__ import annotations

import http.client
import json
import random
import statistics
import threading
import time
from collections import deque
from collections.abc import Sequence
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
    """Every session through ``server`` (a ``vllm_server.Server``), ``concurrency`` requests at
    once, first come first served: a session's next turn joins the back of the queue when its
    answer arrives, so the other sessions' turns run in between — a chat's users think and type
    while others are served. Records in session order, turn by turn."""
    queue: deque[tuple[int, int, list[int]]] = deque((i, 0, []) for i in range(len(sessions)))
    records: dict[tuple[int, int], Record] = {}
    answered: set[str] = set()
    cond = threading.Condition()
    remaining = len(sessions)  # sessions with a turn still to answer

    def stop() -> None:  # no turn starts after this
        nonlocal remaining
        with cond:
            queue.clear()
            remaining = 0
            cond.notify_all()

    def serve() -> None:
        nonlocal remaining
        while True:
            with cond:
                while not queue and remaining:
                    cond.wait()
                if not queue:
                    return
                i, k, history = queue.popleft()
                seen = sessions[i].group in answered
            prompt = history + sessions[i].turns[k]
            try:
                record = stream(server, prompt, output, sessions[i].group, seen)
            except BaseException:
                stop()  # the other threads stop too, and the error is raised by _in_threads
                raise
            with cond:
                answered.add(sessions[i].group)
                records[(i, k)] = record
                if k + 1 < len(sessions[i].turns):
                    queue.append((i, k + 1, prompt + record.tokens))
                else:
                    remaining -= 1
                cond.notify_all()

    _in_threads(serve, concurrency, stop)
    return [records[key] for key in sorted(records)]


def _in_threads(serve: Any, concurrency: int, stop: Any) -> None:
    """``serve`` on ``concurrency`` daemon threads, joined here; the first error is raised. On
    Ctrl-C ``stop`` ends the queue: no new turn starts, and the turns in flight end with the
    server (the caller stops it) instead of holding the exit until every turn was served."""
    failed: list[BaseException] = []

    def client() -> None:
        try:
            serve()
        except BaseException as e:
            failed.append(e)

    clients = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for thread in clients:
        thread.start()
    try:
        for thread in clients:
            thread.join()
    except BaseException:
        stop()
        raise
    if failed:
        raise failed[0]


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
