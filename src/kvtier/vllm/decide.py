"""Load or recompute: per request, from measured rates, how much of a stored prefix is faster
to load than to compute again.

A slow store (a cluster behind a congested link, a disk under other load, a tier that is
failing) makes a hit slower than no hit: the request waits for its load while the engine could
have prefilled those tokens in less time. The scheduler side keeps running estimates and loads
only what pays:

- **each tier of the store**: load time of ``n`` blocks from tier ``i``, ``t = a_i + b_i·n``
  (a least-squares fit with exponential forgetting), from kvtier's own transfers: each load's
  time from submission to its answer, as the vLLM worker sides saw it, with the tier of each
  block its lookup named (``Result.tiers``; one backend is one tier). A load that spans tiers
  is a sample of its slowest tier, less what the others' estimates say their blocks took.
- **the engine**: prefill time per token ``c``, the slope of step time over scheduled tokens,
  from the time between two scheduler steps (steps of at least ``MIN_STEP_TOKENS`` only:
  decode-only steps say little about prefill).

The load of the first ``k`` found blocks is estimated as the largest fixed cost of the tiers it
touches plus ``Σ b_i·n_i``; its recompute as ``c·k·block_size``. Of the prefixes that end where
a run of one tier ends (so one backend gives all or nothing), those whose load is faster than
their recompute — or under ``MIN_DECLINE_S`` anyway — qualify, and the one that saves the most
time is loaded: with ``[memory, slow store]`` the part in memory is loaded and the rest
recomputed. Until the engine and every tier a prefix touches have ``MIN_SAMPLES`` samples the
whole prefix is loaded (that is how the rates are learnt).

Only loads are samples of a tier's load rate. Saves run on their own (niced) thread and queue
behind each other: on a busy machine a fast store's saves wait while its loads are quick, so a
save's time says nothing of a load's (an engine test declined every hit of a fresh engine when
saves were samples). An estimate must still follow a store that recovers though a declined tier
is no longer loaded from: a tier whose estimate is older than ``PROBE_S`` gets one load through
(a probe; one request pays).

A slow first tier is noticed before its first answer: a save still unanswered after ``t``
seconds (the vLLM worker sides report their oldest each step, once it is ``REPORT_WAITING_S``
old: longer than a busy machine keeps a fast store's save waiting) puts a floor under the first
tier's rate, ``t / blocks`` per block, until it is answered — unless loads of it were measured
within ``STALE_S`` (they say more). Once answered, a save that took ``SLOW_SAVE_S`` or more of
the worker's own time (``Result.seconds - Result.cpu_wait_s``: its run, not its queue, less
the time its niced thread waited for a core) keeps that floor, ``seconds / blocks written``,
until loads of the first tier are measured; a faster one lifts it. So a fresh engine does not
pay a slow store's first loads to learn what its saves already said, and a busy machine's queue
of saves, or its CPU, still says nothing.

**No lookup that cannot pay**: while every tier of the store is declined for any length of the
prompt and none is due for a probe, a request is not looked up at all (``worth_looking_up``;
``lookups_skipped``): the answer could only be declined, and vLLM's scheduling loop — every
running request — would wait for it (a lookup's round trip took 1-2.5 ms under ``vllm serve``
on 2 cores, the worker's own part 0.3-0.5 ms of it). Probes and the save probes go on as
above, so a store that recovers is noticed as before. A load estimated under ``MIN_DECLINE_S``
is always taken, so a store known only by a rate (a slow save's floor, loads of one size) is
still looked up while one block of it is estimated under that: its answer may be one block.

**Within the step or not** (``load_mode: auto``, the default): a load estimated shorter than
a step (a moving average of the time between steps) and than ``SYNC_MAX_S`` runs within the
step that schedules it, so its request is computed in that step; a longer one, or one of a
tier not measured yet, runs asynchronously while the request waits (``load_in_step``).

**Saves follow loads**: a prefix whose load from the first tier would be declined is not saved
either. Its save would be worth nothing (the next hit on it would be declined) and would cost
the engine: a request keeps its vLLM blocks until its saves are written, so slow saves fill
the KV cache and later requests queue for space. One declined save still goes out as a probe
(none while a save is still unanswered: that one is), ``STALE_S`` after the last; while saves
stay declined the gap doubles, up to ``PROBE_S`` (each probe holds a request's blocks for as
long as the slow store takes), and it is ``STALE_S`` again once a save is taken.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

KEEP = 0.8  # the weight of the samples before each new one: a sample counts ~5 samples long
MIN_SAMPLES = 2  # the first loads of a slow store must not be paid for to learn it
STALE_S = 2.0
PROBE_S = 30.0  # a declined tier is tried again this often (one request pays)
FLOOR_S = 1.0  # a waiting save's floor holds this long unless reported again (every step)
SLOW_SAVE_S = 0.5  # an answered save this slow (its own time) is a floor: REPORT_WAITING_S's bar
MIN_STEP_TOKENS = 64
MAX_STEP_S = 30.0  # a longer gap between steps is an idle engine, not a step
# A load estimated to take less than this is always taken: declining it could save at most
# this much, and on small models the step-time slope is mostly noise (scheduling overhead).
MIN_DECLINE_S = 0.05
# load_mode auto: a load runs within its step (the forward waits) only if it is estimated at
# most this long — every request running in that step shares the wait.
SYNC_MAX_S = 0.05
# ... and the step waits for it at most this long (20 times that bound): a load that takes it is
# a stalled store, not a slow one. Its blocks are recomputed; the load goes on without the step
# (its request's blocks are kept until it is answered: ``kvtier.vllm.transfers``).
IN_STEP_WAIT_S = 1.0


class LinearFit:
    """``t = a + b·n`` by least squares over recent samples (exponential forgetting)."""

    def __init__(self) -> None:
        self.samples = 0
        self.at = float("-inf")  # time.monotonic() of the last sample
        self._s1 = self._sn = self._st = self._snn = self._snt = 0.0

    def add(self, n: float, t: float) -> None:
        k = KEEP
        self._s1 = self._s1 * k + 1.0
        self._sn = self._sn * k + n
        self._st = self._st * k + t
        self._snn = self._snn * k + n * n
        self._snt = self._snt * k + n * t
        self.samples += 1
        self.at = time.monotonic()

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)``, both >= 0; all samples of one size: ``a = 0``, ``b`` = their mean rate."""
        den = self._s1 * self._snn - self._sn * self._sn
        if den > 1e-9 * max(self._s1 * self._snn, 1e-12):
            b = (self._s1 * self._snt - self._sn * self._st) / den
            a = (self._st - b * self._sn) / self._s1
            if a >= 0 and b >= 0:
                return a, b
            if b < 0:  # time falls with size: noise; the mean time, whatever the size
                return self._st / self._s1, 0.0
        return 0.0, (self._snt / self._snn if self._snn else 0.0)


class LoadOrRecompute:
    """The decision (module docstring). ``enabled=False``: every hit is loaded (measured all
    the same, so the estimates can be inspected)."""

    def __init__(self, block_size: int, enabled: bool = True) -> None:
        self.block_size, self.enabled = block_size, enabled
        self.tiers: list[LinearFit] = [LinearFit()]  # seconds per load of n blocks, per tier
        self.engine = LinearFit()  # seconds per step of n tokens
        self._last_probe_at = self._first_tier_loaded_at = float("-inf")
        self._save_probe_gap = STALE_S  # doubles while saves stay declined, up to PROBE_S
        self._probed_at: dict[int, float] = {}
        self._floor, self._floor_at = 0.0, float("-inf")  # s per block, from a waiting save
        self._saved_floor = 0.0  # s per block, from the last answered save, if it was slow
        self._last_step: tuple[float, int] | None = None
        self._step_s: float | None = None  # a step's time, any tokens (a moving average)

    @property
    def store(self) -> LinearFit:
        """The first tier's fit (the only one of a single backend)."""
        return self.tiers[0]

    def _fit(self, tier: int) -> LinearFit:
        while len(self.tiers) <= tier:
            self.tiers.append(LinearFit())
        return self.tiers[tier]

    # ---- samples ----------------------------------------------------------------------------

    def loaded(self, blocks: int | Sequence[int], seconds: float) -> None:
        """A full load took ``seconds``: ``blocks`` of the first tier, or per tier a count."""
        counts = [blocks] if isinstance(blocks, int) else list(blocks)
        used = [i for i, n in enumerate(counts) if n > 0]
        if not used:
            return
        if used[0] == 0:
            self._first_tier_loaded_at = time.monotonic()
        slowest = used[-1]
        others = 0.0
        for i in used[:-1]:  # their blocks' share of the time, as far as it is known
            if i < len(self.tiers) and self.tiers[i].samples >= MIN_SAMPLES:
                others += self.tiers[i].coefficients()[1] * counts[i]
        self._fit(slowest).add(counts[slowest], max(0.0, seconds - others))

    def waiting(self, blocks: int, seconds: float) -> None:
        """A save of ``blocks`` is unanswered after ``seconds``: the first tier is at least
        that slow (a floor under its rate, until it is answered)."""
        if blocks > 0:
            now = time.monotonic()
            floor = self._floor if now - self._floor_at <= FLOOR_S else 0.0
            self._floor, self._floor_at = max(floor, seconds / blocks), now

    def saved(self, blocks: int, seconds: float) -> None:
        """A save wrote ``blocks`` in ``seconds`` of the worker's own time: if that is
        ``SLOW_SAVE_S`` or more, a floor under the first tier's rate until loads of it are
        measured; if less, no floor (the store is not known to be slow)."""
        if blocks > 0:
            self._saved_floor = seconds / blocks if seconds >= SLOW_SAVE_S else 0.0

    def _floors(self) -> tuple[float, float]:
        """The floors that hold now — a waiting save's, an answered slow save's — unless a load
        of the first tier says more (saves queue on their own: a backlog of saves says nothing
        of how fast loads are answered)."""
        now = time.monotonic()
        if now - self._first_tier_loaded_at <= STALE_S:
            return 0.0, 0.0
        waiting = self._floor if now - self._floor_at <= FLOOR_S else 0.0
        answered = self._saved_floor if self.store.samples < MIN_SAMPLES else 0.0
        return waiting, answered

    def step(self, scheduled_tokens: int, now: float | None = None) -> None:
        """A scheduler step begins that scheduled ``scheduled_tokens``: the previous step took
        the time since the previous call."""
        now = time.monotonic() if now is None else now
        if self._last_step is not None:
            at, tokens = self._last_step
            gap = now - at
            if tokens >= MIN_STEP_TOKENS and 0 < gap < MAX_STEP_S:
                self.engine.add(tokens, gap)
            if tokens > 0 and 0 < gap < MAX_STEP_S:
                last = gap if self._step_s is None else self._step_s
                self._step_s = KEEP * last + (1 - KEEP) * gap
        self._last_step = (now, scheduled_tokens)

    # ---- the decision -----------------------------------------------------------------------

    def estimates(self) -> dict[str, float] | None:
        """The first tier's ``load_fixed_s`` and ``load_s_per_block``, and
        ``prefill_s_per_token``; None until there are enough samples of both."""
        if self.store.samples < MIN_SAMPLES or self.engine.samples < MIN_SAMPLES:
            return None
        a, b = self.store.coefficients()
        _, c = self.engine.coefficients()
        return {"load_fixed_s": a, "load_s_per_block": b, "prefill_s_per_token": c}

    def blocks_to_load(self, found: int, tiers: bytes = b"", now: float | None = None) -> int:
        """Of ``found`` stored blocks (``tiers``: each one's tier, empty: all the first), how
        many leading ones to load."""
        return self._worth(found, tiers, now, floor=max(self._floors()), probe=True)

    def _worth(self, found: int, tiers: bytes, now: float | None, floor: float, probe: bool) -> int:
        """``blocks_to_load``, with ``floor`` seconds per block under the first tier's rate;
        ``probe``: a declined tier due for a probe is loaded (and its probe taken)."""
        if not self.enabled or found <= 0 or self.engine.samples < MIN_SAMPLES:
            return found
        per_token = self.engine.coefficients()[1] * self.block_size
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
            recompute_s = per_token * k
            if load_s < max(recompute_s, MIN_DECLINE_S) and recompute_s - load_s >= best_gain:
                best, best_gain = k, recompute_s - load_s
        if best == found or not probe:
            return best
        return self._probe(found, levels, best, now)

    def worth_looking_up(self, blocks: int, tier_count: int = 1, now: float | None = None) -> bool:
        """Could a lookup of a prompt's next ``blocks`` blocks end in a load? Not when, from
        each of the store's ``tier_count`` tiers, a load of any 1 to ``blocks`` blocks would be
        declined and no tier is due for a probe: whatever the answer, nothing would be loaded,
        so vLLM's scheduling loop does not wait for it (``lookups_skipped``). A load that
        spans tiers costs at least its cheapest tier's load of as many blocks (the largest
        fixed cost, the sum of the rates), so the tiers one by one answer for every mix.
        Load time and recompute are both linear in the blocks: the ends, 1 and ``blocks``,
        answer for every length between."""
        if not self.enabled or blocks <= 0 or self.engine.samples < MIN_SAMPLES:
            return True
        per_block = self.engine.coefficients()[1] * self.block_size
        floor = max(self._floors())
        now = time.monotonic() if now is None else now
        for tier in range(max(tier_count, len(self.tiers))):
            for k in (1, blocks):
                load_s = self._load_s([0] * tier + [k], floor)
                if load_s is None or load_s < max(per_block * k, MIN_DECLINE_S):
                    return True  # not measured yet (learnt by loading), or worth loading
            if self._probe_due(tier, now):
                return True  # a lookup that finds it loads it
        return False

    def load_in_step(self, blocks: int, tiers: bytes = b"") -> bool:
        """``load_mode: auto``: load the first ``blocks`` stored blocks within the step that
        schedules them (the forward waits) rather than asynchronously? Yes when the load is
        estimated shorter than a step and than ``SYNC_MAX_S``. An asynchronous load costs its
        request about one step more (answered during one step, reported at its end, the request
        scheduled in the next); a load within the step costs every running request its time
        once. Unknown rates (a tier not measured, no steps yet): asynchronous."""
        if blocks <= 0 or self._step_s is None:
            return False
        load_s = self._load_s(list(tier_counts(tiers, blocks)), max(self._floors()))
        return load_s is not None and load_s <= min(self._step_s, SYNC_MAX_S)

    def _load_s(self, counts: list[int], first_floor: float) -> float | None:
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
        now = time.monotonic() if now is None else now
        for level in sorted(set(levels[best:])):
            if self._probe_due(level, now):
                self._probed_at[level] = now
                return found
        return best

    def _probe_due(self, tier: int, now: float) -> bool:
        """Is a declined ``tier`` due for a load (``PROBE_S`` since its last sample or probe)?
        Not one measured by a save's floor alone: its save probes are its probes."""
        fit = self.tiers[tier] if tier < len(self.tiers) else None
        if fit is None or fit.samples < MIN_SAMPLES:
            return False
        return now - max(fit.at, self._probed_at.get(tier, float("-inf"))) >= PROBE_S

    def worth_saving(self, blocks: int, now: float | None = None) -> bool:
        """Save a prefix of ``blocks`` blocks (into the first tier)? Yes unless its load would
        be declined; then no, but for a probe now and then (module docstring) — none while a
        save is still waiting (that one is the probe)."""
        waiting, answered = self._floors()
        if blocks <= 0 or self._worth(blocks, b"", now, max(waiting, answered), False) > 0:
            if blocks > 0:
                self._save_probe_gap = STALE_S
            return True
        now = time.monotonic() if now is None else now
        if now - self._last_probe_at < self._save_probe_gap or waiting:
            return False
        if now - self._last_probe_at < 2 * PROBE_S:  # declined since the last probe: back off
            self._save_probe_gap = min(PROBE_S, 2 * self._save_probe_gap)
        self._last_probe_at = now
        return True


def _levels(tiers: bytes, blocks: int) -> bytes:
    """The tier of each of the first ``blocks`` blocks (missing: the first tier)."""
    return tiers[:blocks].ljust(blocks, b"\0")


def tier_counts(tiers: bytes, blocks: int) -> tuple[int, ...]:
    """How many of the first ``blocks`` blocks come from each tier (``tiers``: one byte per
    block; missing: the first tier)."""
    levels = _levels(tiers, blocks)
    return tuple(levels.count(level) for level in range(max(levels, default=0) + 1))
