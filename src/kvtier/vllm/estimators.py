"""Estimators of load and prefill times that noise cannot move far: the numbers the load-or-
recompute decision (``kvtier.vllm.decide``) compares. Each one is built so that a fast store is
never switched off by a few bad samples:

- **a tier of the store** (``RobustFit``): load time of ``n`` blocks, ``t = a + b·n``, from
  its last ``WINDOW_SAMPLES`` loads within ``WINDOW_S``: ``b`` the median of the slopes
  between loads of sizes at least 1.5x apart, ``a`` the median of ``t - b·n``; where sizes do not
  spread (or the line is negative), ``a = 0`` and ``b`` the median time per block. A median
  ignores a few stalls — up to 7 of 16 loads 10x slow move nothing — where a mean of ~5 samples
  (the fit before) was moved by two. Samples are kvtier's own transfers: each load's time from
  submission to its answer, as the vLLM worker sides saw it, with the tier of each block its
  lookup named (``Result.tiers``).
- **the engine** (``EngineRate``): the prefill cost of a token, ``c``, from the time between
  scheduler steps less kvtier's own waits in them (lookups, loads within the step): over the
  last ``STEP_WINDOW`` prefill steps, the mean of the middle half (``middle_mean``) of
  ``(t - t₀) / (n - n₀)``, ``(n₀, t₀)`` the median small step (under ``MIN_STEP_TOKENS``:
  decode), so ``c`` is the marginal cost a prefill adds to a step. Where no small steps are
  known, or that is not positive (noise), the same of ``t / n`` (a rate through the origin,
  which counts the step's fixed cost too): positive times, so ``c`` is never 0 whatever the
  mix of step sizes — the least-squares slope before came out negative in 1-24 % of steps when
  vLLM fills most steps to its token budget, and was then taken as 0 (recompute free: every
  hit declined). The middle half, not the median: as robust to a quarter of stalled steps, and
  about half as noisy on a busy CPU's +-20-40 % step jitter.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from itertools import combinations
from statistics import median

WINDOW_SAMPLES = 16  # a tier's loads remembered: its estimate is their median line
WINDOW_S = 120.0  # ... for this long (the newest MIN_SAMPLES are always kept)
SPREAD = 1.5  # two loads give a slope only if one is this many times the other's size
STEP_WINDOW = 64  # steps remembered, of each kind
MIN_SAMPLES = 2  # the first loads of a slow store must not be paid for to learn it
MIN_STEP_TOKENS = 64  # a step with fewer scheduled tokens is a decode step, not a prefill
MAX_STEP_S = 30.0  # a longer step is an idle engine (a step not seen to end), not a step


class RobustFit:
    """``t = a + b·n`` from the medians of recent samples (module docstring)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.samples = 0  # added, ever
        self.at = float("-inf")  # the clock's time of the last sample
        self._window: deque[tuple[float, float, float]] = deque(maxlen=WINDOW_SAMPLES)
        self._cache: tuple[tuple[int, int], tuple[float, float]] | None = None

    def add(self, n: float, t: float) -> None:
        self.at = self._clock()
        self._window.append((n, t, self.at))
        self.samples += 1

    def recent(self) -> list[tuple[float, float]]:
        """``(n, t)`` of the samples in the window: the last ``WINDOW_SAMPLES`` within
        ``WINDOW_S``, the newest ``MIN_SAMPLES`` whatever their age."""
        now = self._clock()
        kept = [(n, t) for n, t, at in self._window if now - at <= WINDOW_S]
        if len(kept) < MIN_SAMPLES:
            kept = [(n, t) for n, t, _ in list(self._window)[-MIN_SAMPLES:]]
        return kept

    def last(self) -> tuple[float, float] | None:
        return self._window[-1][:2] if self._window else None

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)``, both >= 0."""
        points = self.recent()
        key = (self.samples, len(points))
        if self._cache is None or self._cache[0] != key:
            self._cache = key, _median_line(points)
        return self._cache[1]


def _median_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    if not points:
        return 0.0, 0.0
    slopes = [
        (t2 - t1) / (n2 - n1)
        for (n1, t1), (n2, t2) in combinations(points, 2)
        if min(n1, n2) > 0 and max(n1, n2) >= SPREAD * min(n1, n2)
    ]
    if len(slopes) >= MIN_SAMPLES:
        b = median(slopes)
        a = median(t - b * n for n, t in points) if b >= 0 else -1.0
        if a >= 0:
            return a, b
    return 0.0, median(t / n for n, t in points if n > 0) if any(n > 0 for n, _ in points) else 0.0


class EngineRate:
    """The engine's prefill cost per token and its typical step (module docstring)."""

    def __init__(self) -> None:
        self.samples = 0  # prefill steps, ever
        self._prefill: deque[tuple[float, float]] = deque(maxlen=STEP_WINDOW)
        self._small: deque[tuple[float, float]] = deque(maxlen=STEP_WINDOW)
        self._all: deque[float] = deque(maxlen=STEP_WINDOW)
        self._cache: tuple[tuple[int, int], float] | None = None

    def add(self, tokens: int, seconds: float) -> None:
        """A step of ``tokens`` scheduled tokens took ``seconds`` (kvtier's waits taken out)."""
        self._all.append(seconds)
        if tokens >= MIN_STEP_TOKENS:
            self._prefill.append((tokens, seconds))
            self.samples += 1
        else:
            self._small.append((tokens, seconds))

    def step_s(self) -> float | None:
        """The median step's time (any tokens), or None before the first."""
        return median(self._all) if self._all else None

    def per_token(self) -> float:
        """Seconds a prefill token adds to a step, > 0 once a prefill step is known."""
        key = (self.samples, len(self._small))
        if self._cache is None or self._cache[0] != key:
            self._cache = key, self._per_token()
        return self._cache[1]

    def _per_token(self) -> float:
        if not self._prefill:
            return 0.0
        origin = middle_mean([t / n for n, t in self._prefill])
        if len(self._small) >= MIN_SAMPLES:
            n0 = median(n for n, _ in self._small)
            t0 = median(t for _, t in self._small)
            marginal = middle_mean([(t - t0) / (n - n0) for n, t in self._prefill])
            if marginal > 0:
                return marginal
        return origin


def middle_mean(values: list[float]) -> float:
    """The mean of the middle half (the interquartile mean): as robust as a median to a
    quarter of outliers on either side, and about half as noisy as one on a step's jitter."""
    ordered = sorted(values)
    cut = len(ordered) // 4
    middle = ordered[cut : len(ordered) - cut]
    return sum(middle) / len(middle)


class StepClock:
    """Each engine step's time, for ``EngineRate``: from the step's start (the scheduler's
    ``build_connector_meta``) to its end (``ended``: vLLM asks the scheduler side for its stats
    once the step's output is in), less kvtier's waits within it (``waited``: loads the forward
    waited for). A step not seen to end (async scheduling) lasts until the next one starts, less
    the lookups made before it (``waited(lookup=True)``), and counts only under ``MAX_STEP_S``:
    an idle engine starts its next step whenever a request comes, and a step ended 20 s before
    an 1,800-token step's successor made the per-token cost 30x too high."""

    def __init__(self, rate: EngineRate) -> None:
        self.rate = rate
        self._last: tuple[float, int] | None = None  # (start, scheduled tokens)
        self._ended: float | None = None
        self._in_step_s = self._lookup_s = 0.0

    def waited(self, seconds: float, lookup: bool = False) -> None:
        if lookup:
            self._lookup_s += seconds
        else:
            self._in_step_s += seconds

    def ended(self, now: float) -> None:
        if self._last is not None and self._ended is None:
            self._ended = now

    def started(self, tokens: int, now: float) -> None:
        if self._last is not None:
            at, previous = self._last
            if self._ended is not None:
                seconds = self._ended - at - self._in_step_s
            else:
                seconds = now - at - self._in_step_s - self._lookup_s
            if previous > 0 and 0 < seconds < MAX_STEP_S:
                self.rate.add(previous, seconds)
        self._last, self._ended = (now, tokens), None
        self._in_step_s = self._lookup_s = 0.0
