"""Load or recompute: per request, from measured rates, whether loading a stored prefix is
faster than computing it again.

A slow store (a cluster behind a congested link, a disk under other load, a tier that is
failing) makes a hit slower than no hit: the request waits for its load while the engine could
have prefilled those tokens in less time. The scheduler side keeps two running estimates and
declines a hit whose load would take longer than its recompute:

- **the store**: load time of ``n`` blocks, ``t = a + b·n`` (a least-squares fit with
  exponential forgetting), from kvtier's own transfers: each load's time from submission to
  its answer, as the vLLM worker sides saw it. While loads are declined no load is measured,
  so saves (the same store, off the critical path) keep the estimate current: a save is
  counted when no load was measured for ``STALE_S``.
- **the engine**: prefill time per token ``c``, the slope of step time over scheduled tokens,
  from the time between two scheduler steps (steps of at least ``MIN_STEP_TOKENS`` only:
  decode-only steps say little about prefill).

A hit of ``n`` blocks of ``block_size`` tokens is loaded iff ``a + b·n < c·n·block_size`` or the
load takes less than ``MIN_DECLINE_S`` anyway. Both
costs are linear in ``n``, so the answer is all or nothing: the whole found prefix, or none of
it. Until both estimates have ``MIN_SAMPLES`` samples every hit is loaded.

**Saves follow loads**: a prefix whose load would be declined is not saved either. Its save
would be worth nothing (the next hit on it would be declined) and would cost the engine: a
request keeps its vLLM blocks until its saves are written, so slow saves fill the KV cache and
later requests queue for space. One such save per ``STALE_S`` still goes out, as a probe: its
time keeps the store's estimate current, so a store that recovers is used again.
"""

from __future__ import annotations

import time

KEEP = 0.8  # the weight of the samples before each new one: a sample counts ~5 samples long
MIN_SAMPLES = 2  # the first loads of a slow store must not be paid for to learn it
STALE_S = 2.0
MIN_STEP_TOKENS = 64
MAX_STEP_S = 30.0  # a longer gap between steps is an idle engine, not a step
# A load estimated to take less than this is always taken: declining it could save at most
# this much, and on small models the step-time slope is mostly noise (scheduling overhead).
MIN_DECLINE_S = 0.05


class LinearFit:
    """``t = a + b·n`` by least squares over recent samples (exponential forgetting)."""

    def __init__(self) -> None:
        self.samples = 0
        self._s1 = self._sn = self._st = self._snn = self._snt = 0.0

    def add(self, n: float, t: float) -> None:
        k = KEEP
        self._s1 = self._s1 * k + 1.0
        self._sn = self._sn * k + n
        self._st = self._st * k + t
        self._snn = self._snn * k + n * n
        self._snt = self._snt * k + n * t
        self.samples += 1

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
        self.store = LinearFit()  # seconds per load of n blocks
        self.engine = LinearFit()  # seconds per step of n tokens
        self._last_load_at = self._last_probe_at = float("-inf")
        self._last_step: tuple[float, int] | None = None

    def loaded(self, blocks: int, seconds: float) -> None:
        if blocks > 0:
            self.store.add(blocks, seconds)
            self._last_load_at = time.monotonic()

    def saved(self, blocks: int, seconds: float) -> None:
        if blocks > 0 and time.monotonic() - self._last_load_at > STALE_S:
            self.store.add(blocks, seconds)

    def step(self, scheduled_tokens: int, now: float | None = None) -> None:
        """A scheduler step begins that scheduled ``scheduled_tokens``: the previous step took
        the time since the previous call."""
        now = time.monotonic() if now is None else now
        if self._last_step is not None:
            at, tokens = self._last_step
            if tokens >= MIN_STEP_TOKENS and 0 < now - at < MAX_STEP_S:
                self.engine.add(tokens, now - at)
        self._last_step = (now, scheduled_tokens)

    def estimates(self) -> dict[str, float] | None:
        """``load_fixed_s``, ``load_s_per_block``, ``prefill_s_per_token``, or None until
        there are enough samples of both."""
        if self.store.samples < MIN_SAMPLES or self.engine.samples < MIN_SAMPLES:
            return None
        a, b = self.store.coefficients()
        _, c = self.engine.coefficients()
        return {"load_fixed_s": a, "load_s_per_block": b, "prefill_s_per_token": c}

    def blocks_to_load(self, found: int) -> int:
        """Of ``found`` stored blocks, how many to load: ``found`` or 0."""
        rates = self.estimates() if self.enabled else None
        if rates is None or found <= 0:
            return found
        load_s = rates["load_fixed_s"] + rates["load_s_per_block"] * found
        recompute_s = rates["prefill_s_per_token"] * found * self.block_size
        return found if load_s < max(recompute_s, MIN_DECLINE_S) else 0

    def worth_saving(self, blocks: int, now: float | None = None) -> bool:
        """Save a prefix of ``blocks`` blocks? Yes unless its load would be declined; then no,
        but for one probe per ``STALE_S`` (module docstring)."""
        if blocks <= 0 or self.blocks_to_load(blocks) > 0:
            return True
        now = time.monotonic() if now is None else now
        if now - self._last_probe_at < STALE_S:
            return False
        self._last_probe_at = now
        return True
