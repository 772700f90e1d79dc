"""Load or recompute: per request, from measured rates, how much of a stored prefix is faster
to load than to compute again.

A slow store (a cluster behind a congested link, a disk under other load, a tier that is
failing) makes a hit slower than no hit: the request waits for its load while the engine could
have prefilled those tokens in less time. The scheduler side keeps estimates and loads only
what pays. Each estimate is built so that noise cannot switch a fast store off:

- **each tier of the store**: load time of ``n`` blocks, ``t = a_i + b_i·n``, a median line
  of its recent loads (``kvtier.vllm.estimators.RobustFit``: a few stalls move nothing). A load
  that spans tiers is a sample of its slowest tier, less what the others' estimates say their
  blocks took.
- **the engine**: the prefill cost of a token, the marginal cost a prefill adds to a step, from
  the time between scheduler steps less kvtier's own waits in them (lookups, loads within the
  step) (``kvtier.vllm.estimators.EngineRate``: never 0, whatever the mix of step sizes).
- **the always-take floor**: a load estimated shorter than the engine's median step
  (``EngineRate.step_s``, decode steps mostly) is always taken. Declining it gains less than one
  step, which is within the noise of the estimates. It scales with the engine: ~50 ms for the
  bench's model on these 2 cores, 5-30 ms for a GPU's decode step, where a 45 ms load against a
  20 ms recompute is now declined (the constant 50 ms before took it).

The load of the first ``k`` found blocks is estimated as the largest fixed cost of the tiers it
touches plus ``Σ b_i·n_i``; its recompute as ``c·k·block_size``. Of the prefixes that end where
a run of one tier ends (so one backend gives all or nothing), those whose load is faster than
their recompute — or under the floor — qualify, and the one that saves the most time is loaded:
with ``[memory, slow store]`` the part in memory is loaded and the rest recomputed. Until the
engine and every tier a prefix touches are measured the whole prefix is loaded (that is how the
rates are learnt): a tier needs ``MIN_SAMPLES`` loads; the engine's estimate is used with a
margin (``EARLY_MARGIN``: only a load 3x slower is declined) from its first prefill step, in
full from ``ENGINE_MIN_STEPS``.

**Probes**: only loads measure a tier, and a declined tier is not loaded from, so a declined
tier gets one load through (a probe; one request pays) ``PROBE_S`` after its last sample or
probe — or ``PROBE_SOON_S`` after, when the decline rests on fewer than ``CONFIDENT_SAMPLES``
loads or the last sample alone would have been taken (a store coming back is taken back within
a few probes). Each gap is drawn from ``[1 - PROBE_JITTER, 1]`` of its length, so probes do not
fall into a periodic slowdown in step with it.

**Saves as evidence, before any load**: a fresh engine should not pay a slow store's first
loads to learn what its saves already show. While the first tier has fewer than
``MIN_SAMPLES`` loads measured, (1) a save still unanswered and **blocked on the store** for
``t`` seconds (the kvtier worker's save watch, reported on its heartbeats: not its queue, not
its niced thread's waits for a core — a busy machine's time; ``REPORT_WAITING_S`` at least)
puts a floor ``t / blocks`` under the first tier's rate while it is reported; (2) an answered
save that took ``SLOW_SAVE_S`` or more of the worker's own time keeps the floor ``seconds /
blocks``, until a faster save lifts it. Once loads are measured they alone decide: a save that
waited says nothing of a load (the fit before let one 0.6 s save override measured 25 ms loads).

**No lookup that cannot pay**: while every tier of the store is declined for any length of the
prompt and none is due for a probe, a request is not looked up at all (``worth_looking_up``;
``lookups_skipped``): the answer could only be declined, and vLLM's scheduling loop — every
running request — would wait for it (a lookup's round trip took 1-2.5 ms under ``vllm serve``
on 2 cores).

**Within the step or not** (``load_mode: auto``, the default), per request from that hit's own
estimate: a load estimated shorter than a step (the median step) and than ``SYNC_MAX_S`` runs
within the step that schedules it, so its request is computed in that step; a longer one, or one
of a tier not measured yet, runs asynchronously while the request waits (``load_in_step``).

**Saves follow loads**: a prefix whose load from the first tier would be declined is not saved
either (its next hit would be declined; a request keeps its vLLM blocks until its saves are
written, so slow saves fill the KV cache). One declined save still goes out as a probe (none
while a save is still unanswered: that one is), ``STALE_S`` after the last; while saves stay
declined the gap doubles, up to ``PROBE_S``, and it is ``STALE_S`` again once a save is taken.

**Visible**: ``estimates()`` (the engine's and each tier's, exported as gauges) and
``explain()`` (why a prefix was declined: the scheduler logs it, rate-limited).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.vllm.estimators import MIN_SAMPLES, EngineRate, RobustFit, StepClock

# Prefill steps before anything is declined: a step's time varies +-20-40 % on a busy CPU, and a
# median of 8 tells a load 1.25x faster than recompute apart (of 2-6, it did not: unit tests).
# Steps are many (every request's prefill), so this costs no store a paid-for load.
ENGINE_MIN_STEPS = 8
# Before that, from the first prefill step on, only a load this many times slower than the
# rough estimate is declined (a store 2 s a load is not paid for while the engine is learnt).
EARLY_MARGIN = 3.0
CONFIDENT_SAMPLES = 5  # a decline on fewer loads is probed again soon
STALE_S = 2.0
PROBE_S = 30.0  # a declined tier is tried again this often (one request pays)...
PROBE_SOON_S = 3.0  # ... or this often while its decline is not yet sure
PROBE_JITTER = 0.5  # each probe gap is drawn from [1 - PROBE_JITTER, 1] of its length
FLOOR_S = 1.0  # a waiting save's floor holds this long unless reported again (every step)
SLOW_SAVE_S = 0.5  # an answered save this slow (its own time) is a floor: REPORT_WAITING_S's bar
# load_mode auto: a load runs within its step (the forward waits) only if it is estimated at
# most this long — every request running in that step shares the wait.
SYNC_MAX_S = 0.05
# ... and the step waits for it at most this long (20 times that bound): a load that takes it is
# a stalled store, not a slow one. Its blocks are recomputed; the load goes on without the step
# (its request's blocks are kept until it is answered: ``kvtier.vllm.transfers``).
IN_STEP_WAIT_S = 1.0


@dataclass(frozen=True)
class Verdict:
    """Why a prefix of ``found`` blocks was (partly) declined: ``explain``."""

    found: int
    loaded: int
    load_s: float | None  # the whole prefix's load, estimated (None: a tier not measured)
    recompute_s: float
    always_take_s: float
    tiers: tuple[int, ...]  # blocks per tier


class LoadOrRecompute:
    """The decision (module docstring). ``enabled=False``: every hit is loaded (measured all
    the same, so the estimates can be inspected). ``seed``: the probes' jitter; ``clock``:
    ``time.monotonic`` (a simulation's own: ``kvtier_bench.decide``)."""

    def __init__(
        self,
        block_size: int,
        enabled: bool = True,
        seed: int | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.block_size, self.enabled = block_size, enabled
        self._clock = clock or (lambda: time.monotonic())
        self.tiers: list[RobustFit] = [RobustFit(self._clock)]  # per tier: s per load of n blocks
        self.engine = EngineRate()
        self.steps = StepClock(self.engine)
        self._rng = random.Random(seed)
        self._last_probe_at = float("-inf")
        self._save_probe_gap = STALE_S  # doubles while saves stay declined, up to PROBE_S
        self._probed_at: dict[int, float] = {}
        self._jitter: dict[int, float] = {}  # per tier: the fraction of its next probe gap
        self._floor, self._floor_at = 0.0, float("-inf")  # s per block, from a blocked save
        self._saved_floor = 0.0  # s per block, from the last answered save, if it was slow

    @property
    def store(self) -> RobustFit:
        """The first tier's fit (the only one of a single backend)."""
        return self.tiers[0]

    def _fit(self, tier: int) -> RobustFit:
        while len(self.tiers) <= tier:
            self.tiers.append(RobustFit(self._clock))
        return self.tiers[tier]

    # ---- samples ----------------------------------------------------------------------------

    def loaded(self, blocks: int | Sequence[int], seconds: float) -> None:
        """A full load took ``seconds``: ``blocks`` of the first tier, or per tier a count."""
        counts = [blocks] if isinstance(blocks, int) else list(blocks)
        used = [i for i, n in enumerate(counts) if n > 0]
        if not used:
            return
        slowest = used[-1]
        others = 0.0
        for i in used[:-1]:  # their blocks' share of the time, as far as it is known
            if i < len(self.tiers) and self.tiers[i].samples >= MIN_SAMPLES:
                others += self.tiers[i].coefficients()[1] * counts[i]
        self._fit(slowest).add(counts[slowest], max(0.0, seconds - others))
        self._jitter.pop(slowest, None)

    def waiting(self, blocks: int, seconds: float) -> None:
        """A save of ``blocks`` has been blocked on the store for ``seconds`` (its queue and
        its waits for a core left out) and is still unanswered: a floor under the first tier's
        rate while no load of it is measured."""
        if blocks > 0:
            now = self._clock()
            floor = self._floor if now - self._floor_at <= FLOOR_S else 0.0
            self._floor, self._floor_at = max(floor, seconds / blocks), now

    def saved(self, blocks: int, seconds: float) -> None:
        """A save wrote ``blocks`` in ``seconds`` of the worker's own time: if that is
        ``SLOW_SAVE_S`` or more, a floor under the first tier's rate while no load of it is
        measured; if less, no floor (the store is not known to be slow)."""
        if blocks > 0:
            self._saved_floor = seconds / blocks if seconds >= SLOW_SAVE_S else 0.0

    def _floors(self) -> tuple[float, float]:
        """The save floors that hold now — a blocked save's, an answered slow save's — while
        the first tier's loads are not measured (once they are, they alone say how fast it is)."""
        if self.store.samples >= MIN_SAMPLES:
            return 0.0, 0.0
        waiting = self._floor if self._clock() - self._floor_at <= FLOOR_S else 0.0
        return waiting, self._saved_floor

    def step(self, scheduled_tokens: int, now: float | None = None, kvtier_s: float = 0.0) -> None:
        """A scheduler step begins that scheduled ``scheduled_tokens``; the previous one took
        until ``step_ended`` (else until now), less kvtier's own waits in it (``kvtier_s`` and
        ``waited``: loads within the step; lookups before this one): ``StepClock``."""
        self.steps.waited(kvtier_s)
        self.steps.started(scheduled_tokens, self._clock() if now is None else now)

    def step_ended(self, now: float | None = None) -> None:
        """The latest step's output is in: its time ends here, however long the engine then
        idles before the next."""
        self.steps.ended(self._clock() if now is None else now)

    def waited(self, seconds: float, lookup: bool = False) -> None:
        """kvtier held the engine's loop ``seconds``: a lookup, or a load within the step."""
        self.steps.waited(seconds, lookup)

    # ---- the decision -----------------------------------------------------------------------

    def _margin(self) -> float:
        """How many times slower than its recompute a load may be and still be taken: 1 once
        the engine is measured, ``EARLY_MARGIN`` from its first prefill step, no bound before."""
        if self.engine.samples >= ENGINE_MIN_STEPS:
            return 1.0
        return EARLY_MARGIN if self.engine.samples else float("inf")

    def _always_take_s(self) -> float:
        return self.engine.step_s() or 0.0

    def blocks_to_load(self, found: int, tiers: bytes = b"", now: float | None = None) -> int:
        """Of ``found`` stored blocks (``tiers``: each one's tier, empty: all the first), how
        many leading ones to load."""
        return self._worth(found, tiers, now, floor=max(self._floors()), probe=True)

    def _worth(self, found: int, tiers: bytes, now: float | None, floor: float, probe: bool) -> int:
        """``blocks_to_load``, with ``floor`` seconds per block under the first tier's rate;
        ``probe``: a declined tier due for a probe is loaded (and its probe taken)."""
        margin = self._margin()
        if not self.enabled or found <= 0 or margin == float("inf"):
            return found
        per_block = self.engine.per_token() * self.block_size * margin
        always = self._always_take_s()
        levels = _levels(tiers, found)
        counts = [0] * (max(levels) + 1)
        best, best_gain = 0, float("-inf")
        for k, level in enumerate(levels, 1):
            counts[level] += 1
            if k < found and levels[k] == level:
                continue  # only prefixes that end where a run of one tier ends
            load_s = self._load_s(counts, floor)
            if load_s is None:
                return found  # a tier not measured yet: learn it
            recompute_s = per_block * k
            if load_s < max(recompute_s, always) and recompute_s - load_s >= best_gain:
                best, best_gain = k, recompute_s - load_s
        if best == found or not probe:
            return best
        return self._probe(found, levels, best, now)

    def explain(self, found: int, tiers: bytes = b"") -> Verdict:
        """What the decision saw for ``found`` stored blocks (for the log of a decline)."""
        levels = _levels(tiers, found)
        counts = [levels.count(level) for level in range(max(levels, default=0) + 1)]
        return Verdict(
            found,
            self._worth(found, tiers, None, max(self._floors()), probe=False),
            self._load_s(counts, max(self._floors())),
            self.engine.per_token() * self.block_size * found,
            self._always_take_s(),
            tuple(counts),
        )

    def worth_looking_up(self, blocks: int, tier_count: int = 1, now: float | None = None) -> bool:
        """Could a lookup of a prompt's next ``blocks`` blocks end in a load? Not when, from
        each of the store's ``tier_count`` tiers, a load of any 1 to ``blocks`` blocks would be
        declined and no tier is due for a probe: whatever the answer, nothing would be loaded,
        so vLLM's scheduling loop does not wait for it (``lookups_skipped``). A load that
        spans tiers costs at least its cheapest tier's load of as many blocks (the largest
        fixed cost, the sum of the rates), so the tiers one by one answer for every mix.
        Load time and recompute are both linear in the blocks: the ends, 1 and ``blocks``,
        answer for every length between."""
        margin = self._margin()
        if not self.enabled or blocks <= 0 or margin == float("inf"):
            return True
        per_block = self.engine.per_token() * self.block_size * margin
        always = self._always_take_s()
        floor = max(self._floors())
        now = self._clock() if now is None else now
        for tier in range(max(tier_count, len(self.tiers))):
            for k in (1, blocks):
                load_s = self._load_s([0] * tier + [k], floor)
                if load_s is None or load_s < max(per_block * k, always):
                    return True  # not measured yet (learnt by loading), or worth loading
            if self._probe_due(tier, now):
                return True  # a lookup that finds it loads it
        return False

    def load_in_step(self, blocks: int, tiers: bytes = b"") -> bool:
        """``load_mode: auto``, per request: load the first ``blocks`` stored blocks within the
        step that schedules them (the forward waits) rather than asynchronously? Yes when this
        load is estimated shorter than a (median) step and than ``SYNC_MAX_S``. An asynchronous
        load costs its request about one step more (answered during one step, reported at its
        end, the request scheduled in the next); a load within the step costs every running
        request its time once. Unknown rates (a tier not measured, no steps yet): asynchronous."""
        step_s = self.engine.step_s()
        if blocks <= 0 or step_s is None:
            return False
        load_s = self._load_s(list(tier_counts(tiers, blocks)), max(self._floors()))
        return load_s is not None and load_s <= min(step_s, SYNC_MAX_S)

    def _load_s(self, counts: Sequence[int], first_floor: float) -> float | None:
        fixed, per_block = 0.0, 0.0
        for i, n in enumerate(counts):
            if not n:
                continue
            floor = first_floor if i == 0 else 0.0
            if i < len(self.tiers) and self.tiers[i].samples >= MIN_SAMPLES:
                a, b = self.tiers[i].coefficients()
            elif floor:
                a, b = 0.0, floor
            else:
                return None
            fixed, per_block = max(fixed, a), per_block + max(b, floor) * n
        return fixed + per_block

    def _probe(self, found: int, levels: bytes, best: int, now: float | None) -> int:
        """``best``, or ``found`` when a declined tier is due for a probe."""
        now = self._clock() if now is None else now
        for level in sorted(set(levels[best:])):
            if self._probe_due(level, now):
                self._probed_at[level] = now
                self._jitter.pop(level, None)
                return found
        return best

    def _probe_due(self, tier: int, now: float) -> bool:
        """Is a declined ``tier`` due for a load? Not one measured by a save's floor alone:
        its save probes are its probes."""
        fit = self.tiers[tier] if tier < len(self.tiers) else None
        if fit is None or fit.samples < MIN_SAMPLES:
            return False
        if tier not in self._jitter:
            self._jitter[tier] = 1.0 - PROBE_JITTER * self._rng.random()
        gap = PROBE_SOON_S if self._unsure(fit) else PROBE_S
        since = max(fit.at, self._probed_at.get(tier, float("-inf")))
        return now - since >= gap * self._jitter[tier]

    def _unsure(self, fit: RobustFit) -> bool:
        """Does a decline of this tier rest on little: few loads, or a last load that alone
        would have been taken?"""
        last = fit.last()
        if len(fit.recent()) < CONFIDENT_SAMPLES or last is None:
            return True
        n, t = last
        return t < max(self.engine.per_token() * self.block_size * n, self._always_take_s())

    def worth_saving(self, blocks: int, now: float | None = None) -> bool:
        """Save a prefix of ``blocks`` blocks (into the first tier)? Yes unless its load would
        be declined; then no, but for a probe now and then (module docstring) — none while a
        save is still waiting (that one is the probe)."""
        waiting, answered = self._floors()
        if blocks <= 0 or self._worth(blocks, b"", now, max(waiting, answered), False) > 0:
            if blocks > 0:
                self._save_probe_gap = STALE_S
            return True
        now = self._clock() if now is None else now
        if now - self._last_probe_at < self._save_probe_gap or waiting:
            return False
        if now - self._last_probe_at < 2 * PROBE_S:  # declined since the last probe: back off
            self._save_probe_gap = min(PROBE_S, 2 * self._save_probe_gap)
        self._last_probe_at = now
        return True

    # ---- what it sees -----------------------------------------------------------------------

    def estimates(self) -> dict[str, float]:
        """The estimates in force (gauges): ``prefill_s_per_token``, ``step_s`` (the always-take
        floor), and per measured tier ``tier<i>_load_fixed_s`` / ``tier<i>_load_s_per_block``;
        ``save_floor_s_per_block`` while a save's floor holds. Empty until the engine is
        measured."""
        if not self.engine.samples:
            return {}
        out = {"prefill_s_per_token": self.engine.per_token(), "step_s": self._always_take_s()}
        for i, fit in enumerate(self.tiers):
            if fit.samples >= MIN_SAMPLES:
                a, b = fit.coefficients()
                out[f"tier{i}_load_fixed_s"], out[f"tier{i}_load_s_per_block"] = a, b
        floor = max(self._floors())
        if floor:
            out["save_floor_s_per_block"] = floor
        return out


def _levels(tiers: bytes, blocks: int) -> bytes:
    """The tier of each of the first ``blocks`` blocks (missing: the first tier)."""
    return tiers[:blocks].ljust(blocks, b"\0")


def tier_counts(tiers: bytes, blocks: int) -> tuple[int, ...]:
    """How many of the first ``blocks`` blocks come from each tier (``tiers``: one byte per
    block; missing: the first tier)."""
    levels = _levels(tiers, blocks)
    return tuple(levels.count(level) for level in range(max(levels, default=0) + 1))
