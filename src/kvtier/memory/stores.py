"""Which stores kvtier's native copies write with, chosen per process by timing its own copies.

Streaming (non-temporal) stores skip the read-for-ownership of the destination: a copy moves 2
bytes of memory traffic per byte instead of 3. On the hosts of stops 43-50 they made a copy on two
threads 23-25 GB/s, the fastest plain copy there. On stop 51's host the same stores ran at
8-12 GB/s where copies through the cache ran at 13-23 (``kvtier bench copy``'s
``limit_gbps_each``; a hashed scattered copy: 8.3 against 13-14 GB/s); stop 52's streaming copy
(four pages side by side, copy_kernels.h) runs at 20-23 there. Which is faster is the host's
(its memory system, and what a hypervisor makes of streaming stores), so it is measured where
kvtier runs: the first ``SAMPLES`` copies of at least ``MIN_BYTES`` in the process are each run
twice, once with each kind (a copy is idempotent: the same bytes land twice; the order
alternates, so neither kind always finds the source in cache or the destination's pages
faulted in), and the kind with the higher best rate is kept — a page fault or a busy neighbour
only ever slows a copy down, so the best of a kind's copies says what the stores can do, where
stop 51's median of unpaired copies once chose the slower kind after one copy into fresh memory.
Both write the same bytes. ``KVTIER_COPY_STORES=streaming|cached`` fixes the kind (no timing).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

ENV = "KVTIER_COPY_STORES"
KINDS = ("streaming", "cached")
SAMPLES = 3  # copies timed with each kind before choosing (a stall slows one, not all three)
MIN_BYTES = 4 << 20  # smaller copies say more about their set-up than about the stores

T = TypeVar("T")


class StoreChoice:
    """The store kind of one process's native copies (``native``: ``kvtier._copy``)."""

    def __init__(
        self,
        native: Any,
        setting: str = "auto",
        samples: int = SAMPLES,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._native, self._samples, self._clock = native, samples, clock
        self._rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
        self._lock = threading.Lock()
        self.kind: str | None = None  # None: still timing
        if setting in KINDS:
            self._keep(setting)
        elif setting != "auto":
            raise ConfigError(ENV, f"{setting!r} is not one of streaming, cached, auto")

    def run(self, nbytes: int, copy: Callable[[], T]) -> T:
        """``copy()``'s result; while choosing, ``copy`` runs once with each kind, timed."""
        if self.kind is not None or nbytes < MIN_BYTES:
            return copy()
        with self._lock:  # one timed copy at a time: the kind is the process's
            if self.kind is not None:
                return copy()
            pair = len(self._rates["streaming"])
            for kind in KINDS if pair % 2 == 0 else KINDS[::-1]:
                self._native.set_streaming(kind == "streaming")
                start = self._clock()
                result = copy()
                self._rates[kind].append(nbytes / max(self._clock() - start, 1e-9))
            if pair + 1 >= self._samples:
                best = {k: max(r) for k, r in self._rates.items()}
                self._keep(max(KINDS, key=lambda k: best[k]))
                log.info(
                    "native copies use %s stores (best timed: %s)",
                    self.kind,
                    ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in best.items()),
                )
            return result

    def rates(self) -> dict[str, list[float]]:
        """Bytes per second of each timed copy, per kind."""
        with self._lock:
            return {k: list(v) for k, v in self._rates.items()}

    def describe(self) -> str:
        """One line: the kind in use and the rates timed (GB/s, per kind)."""
        rates = self.rates()
        timed = "; ".join(f"{k} {' '.join(f'{r / 1e9:.1f}' for r in v)}" for k, v in rates.items())
        return f"{self.kind or 'still timing'} stores (timed GB/s: {timed or 'none'})"

    def _keep(self, kind: str) -> None:
        self._native.set_streaming(kind == "streaming")
        self.kind = kind


_choice: StoreChoice | None = None
_choice_lock = threading.Lock()


def choice(native: Any) -> StoreChoice:
    """This process's choice (made on first use, from ``$KVTIER_COPY_STORES``)."""
    global _choice
    if _choice is None:
        with _choice_lock:
            if _choice is None:
                _choice = StoreChoice(native, os.environ.get(ENV, "auto").strip() or "auto")
    return _choice
