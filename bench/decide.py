"""Load or recompute, replayed: sequences of engine steps and loads whose true costs are known,
fed to kvtier's decision (``kvtier.vllm.decide``) on a simulated clock, against an oracle.

Each scenario is a stream of requests between decode steps. A request either misses (a new
prompt: prefill steps of up to ``budget`` tokens, as vLLM fills them) or finds ``hit_blocks``
stored blocks; the decision says how many to load (or skips the lookup), the load takes its
true time (stalls included) and is a sample, the rest is prefilled. The oracle knows the
store's usual cost (no stalls) and the engine's true prefill cost and loads exactly when that
is faster. Reported: hits the oracle takes, hits the decision takes, **hits lost** (the oracle
loads, the decision declines), **slow loads** (the decision loads what is over 1.2x its
recompute: probes included) and the time that cost against the oracle. The limit is the
oracle's own row: 0 lost, 0 slow.

The scenarios are the ones an audit of the decision named (round 5): steps filled to vLLM's
token budget with jitter, one save blocked 0.6 s after measured loads, two stalls among fast
loads, stalls in 3 % of loads, slowdowns 3 % of the time, a GPU-sized step, a slow store.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvtier.vllm.decide import LoadOrRecompute

BLOCK = 16
DECODE_TOKENS = 3  # three requests in flight: a decode step schedules three tokens
TAIL_TOKENS = 40  # a hit's own tokens after the stored prefix


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    decode_s: float  # a decode step's true time
    per_token_s: float  # a prefill token's true marginal cost
    load_fixed_s: float  # the store's usual load: fixed + per block
    load_per_block_s: float
    hit_blocks: int = 112
    requests: int = 300
    miss_tokens: tuple[int, ...] = (2048, 2048, 2048, 1802)  # misses' prompts, in turn
    hit_every: int = 2  # every second request is a hit
    decodes_between: int = 4
    step_jitter: float = 0.0  # each step's time x U(1 - j, 1 + j)
    stall_rate: float = 0.0  # this share of loads take stall_factor x their time
    stall_at: tuple[int, ...] = ()  # ... and these loads (0-based), whatever the rate
    stall_factor: float = 10.0
    slow_share: float = 0.0  # this share of the time (in windows of slow_window_s) loads are slow
    slow_window_s: float = 1.0
    blocked_save: tuple[int, float, float] | None = None  # (after request, idle s, blocked s)


@dataclass
class Outcome:
    scenario: str
    requests: int = 0
    hits: int = 0
    oracle_loads: int = 0
    loads: int = 0
    hits_lost: int = 0
    slow_loads: int = 0
    hit_tokens: int = 0
    oracle_hit_tokens: int = 0
    lookups_skipped: int = 0
    seconds_vs_oracle: float = 0.0
    notes: list[str] = field(default_factory=list)


CPU: dict[str, Any] = {"decode_s": 0.05, "per_token_s": 0.25 / 1792}  # 1,792 tokens: 250 ms
# a fast store: 25 ms for 14 blocks (recompute 250 ms)
FAST: dict[str, Any] = {
    **CPU,
    "load_fixed_s": 0.0,
    "load_per_block_s": 0.025 / 14,
    "hit_blocks": 14,
}


def scenarios() -> list[Scenario]:
    cpu, fast, slow_store = CPU, FAST, {**FAST, "load_fixed_s": 2.0, "load_per_block_s": 0.0}
    return [
        Scenario(
            "budget",
            "steps of 2,048 / 1,802 tokens, +-40 % jitter; a 200 ms load vs 250 ms recompute",
            step_jitter=0.4,
            load_fixed_s=0.0,
            load_per_block_s=0.2 / 112,
            **cpu,
        ),
        Scenario(
            "budget-slow",
            "the same steps; a load 1.3x its recompute (325 ms vs 250 ms)",
            step_jitter=0.4,
            load_fixed_s=0.0,
            load_per_block_s=0.325 / 112,
            **cpu,
        ),
        Scenario(
            "blocked-save",
            "three 25 ms loads, 3 s without one, a 1-block save blocked 0.6 s",
            blocked_save=(6, 3.0, 0.6),
            **fast,
        ),
        Scenario(
            "two-stalls",
            "two 600 ms stalls among 25 ms loads (recompute 17.9 ms a block)",
            stall_at=(1, 3),
            stall_factor=24.0,
            **fast,
        ),
        Scenario(
            "stalls-3%",
            "loads 10x slow in 3 % of loads, at random",
            stall_rate=0.03,
            **fast,
        ),
        Scenario(
            "slowdowns-3%",
            "loads 10x slow 3 % of the time (1 s windows)",
            slow_share=0.03,
            **fast,
        ),
        Scenario(
            "gpu-step",
            "GPU-sized steps (10 ms decode, 2k tokens +15 ms); a 45 ms load of 1,536 tokens",
            decode_s=0.010,
            per_token_s=0.015 / 2048,
            load_fixed_s=0.045,
            load_per_block_s=0.0,
            hit_blocks=96,
        ),
        Scenario("slow-store", "a store 2 s a transfer (recompute 250 ms)", **slow_store),
    ]


class _Replay:
    """One run of a scenario: the simulated clock, the decision, the outcome so far."""

    def __init__(self, s: Scenario, seed: int, make: Callable[..., Any] | None) -> None:
        self.s, self.rng, self.clock = s, random.Random(seed), 1000.0
        now = lambda: self.clock  # noqa: E731
        self.d = make(now) if make is not None else LoadOrRecompute(BLOCK, seed=seed, clock=now)
        self.out = Outcome(s.name)
        self.loads_done = 0

    def step(self, tokens: int, true_s: float) -> None:
        self.d.step(tokens, self.clock)
        self.clock += true_s * (1 + self.s.step_jitter * (2 * self.rng.random() - 1))

    def prefill(self, tokens: int) -> None:
        while tokens > 0:
            chunk = min(tokens, self.s.miss_tokens[0])
            self.step(chunk, self.s.decode_s + self.s.per_token_s * chunk)
            tokens -= chunk

    def load_s(self, blocks: int) -> float:
        """A load's true time now: the usual, or stall_factor x that in a stall."""
        s, seconds = self.s, self.s.load_fixed_s + self.s.load_per_block_s * blocks
        slow_now = s.slow_share and self.clock % (s.slow_window_s / s.slow_share) < s.slow_window_s
        if self.loads_done in s.stall_at or self.rng.random() < s.stall_rate or slow_now:
            seconds *= s.stall_factor
        self.loads_done += 1
        return seconds

    def hit(self) -> None:
        s, d, out, found = self.s, self.d, self.out, self.s.hit_blocks
        out.hits += 1
        usual = s.load_fixed_s + s.load_per_block_s * found
        recompute = s.per_token_s * found * BLOCK
        oracle = found if usual < recompute else 0
        out.oracle_loads += oracle > 0
        out.oracle_hit_tokens += oracle * BLOCK
        looked_up = d.worth_looking_up(found)
        out.lookups_skipped += not looked_up
        k = d.blocks_to_load(found) if looked_up else 0
        cost = s.per_token_s * (found - k) * BLOCK
        if k:
            load_s = self.load_s(k)
            d.loaded(k, load_s)
            self.clock += load_s  # the request waits for it; the engine's next steps follow it
            cost += load_s
            out.loads += 1
            out.hit_tokens += k * BLOCK
            out.slow_loads += usual > 1.2 * recompute
        out.hits_lost += bool(oracle and k < found)
        out.seconds_vs_oracle += cost - (usual if oracle else recompute)
        self.prefill(TAIL_TOKENS + (found - k) * BLOCK)


def replay(s: Scenario, seed: int = 0, make: Callable[..., Any] | None = None) -> Outcome:
    """One run of ``s`` through a fresh decision on a simulated clock (``make(clock)``: another
    decision to replay, e.g. an older one)."""
    run = _Replay(s, seed, make)
    misses = 0
    for i in range(s.requests):
        for _ in range(s.decodes_between):
            run.step(DECODE_TOKENS, s.decode_s)
        if s.blocked_save is not None and i == s.blocked_save[0]:
            run.clock += s.blocked_save[1]  # no load meanwhile
            run.d.waiting(1, s.blocked_save[2])
        run.out.requests += 1
        if i % s.hit_every:
            run.prefill(s.miss_tokens[misses % len(s.miss_tokens)])
            misses += 1
        else:
            run.hit()
    run.out.seconds_vs_oracle = round(run.out.seconds_vs_oracle, 3)
    return run.out


def run_all(seed: int = 0, make: Callable[..., Any] | None = None) -> list[Outcome]:
    outcomes = []
    for s in scenarios():
        outcome = replay(s, seed, make)
        if s.stall_rate or s.stall_at or s.slow_share:  # beside the same run without stalls
            calm = replay(replace(s, stall_rate=0.0, stall_at=(), slow_share=0.0), seed, make)
            ratio = outcome.hit_tokens / calm.hit_tokens if calm.hit_tokens else 1.0
            outcome.notes.append(f"hit tokens / the same run without stalls: {ratio:.3f}")
        outcomes.append(outcome)
    return outcomes


def report(args: argparse.Namespace) -> int:
    outcomes = run_all(args.seed)
    if args.json:
        for o in outcomes:
            print(json.dumps(asdict(o)))
        return 0
    header = (
        f"{'scenario':<13} {'hits':>5} {'oracle':>6} {'loaded':>6} {'lost':>5} {'slow':>5} "
        f"{'skipped':>7} {'s vs oracle':>11}"
    )
    print(header)
    print("-" * len(header))
    for o in outcomes:
        print(
            f"{o.scenario:<13} {o.hits:>5} {o.oracle_loads:>6} {o.loads:>6} {o.hits_lost:>5} "
            f"{o.slow_loads:>5} {o.lookups_skipped:>7} {o.seconds_vs_oracle:>11.2f}"
        )
    for s, o in zip(scenarios(), outcomes):
        print(f"  {s.name}: {s.what}" + "".join(f"; {n}" for n in o.notes))
    print("oracle: loads exactly when the usual load is faster than recompute (0 lost, 0 slow)")
    return 0


if __name__ == "__main__":
    from kvtier_bench.options import decide_arguments

    parser = argparse.ArgumentParser(prog="kvtier bench decide")
    decide_arguments(parser)
    sys.exit(report(parser.parse_args()))
