"""Shared benchmark helpers: timing medians, readable tables, JSON rows."""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kvtier.ops.table import print_table


def median_seconds(
    fn: Callable[[], object], runs: int, sync: Callable[[], None] = lambda: None
) -> float:
    """Median wall time of ``runs`` calls of ``fn`` (one untimed warm-up call first)."""
    fn()
    sync()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class Timing(NamedTuple):
    """Seconds of several timed runs: the median and the spread (``samples``: each run's, in
    order)."""

    median: float
    fastest: float
    slowest: float
    samples: tuple[float, ...] = ()

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Timing:
        return cls(statistics.median(seconds), min(seconds), max(seconds), tuple(seconds))

    def gbps_range(self, num_bytes: int) -> str:
        """'min-max' GB/s of the runs (slowest run first)."""
        return f"{gbps(num_bytes, self.slowest):.2f}-{gbps(num_bytes, self.fastest):.2f}"


def interleaved_timings(
    fns: dict[str, Callable[[], object]],
    runs: int,
    sync: Callable[[], None] = lambda: None,
    min_sample_s: float = 0.0,
    alternate: bool = False,
) -> dict[str, Timing]:
    """Seconds per call of each function, run in turn each round so that all of them see the
    same machine noise (these machines are shared). The first round warms up, is not counted,
    and sizes each sample: a function that takes less than ``min_sample_s`` is called several
    times per sample (a millisecond call timed alone swings by tens of percent).
    ``alternate``: the order turns each round (none always runs first)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    repeats = dict.fromkeys(fns, 1)
    for round_ in range(runs + 1):
        turn = list(fns.items())
        for name, fn in reversed(turn) if alternate and round_ % 2 else turn:
            sync()
            start = time.perf_counter()
            for _ in range(repeats[name]):
                fn()
            sync()
            elapsed = (time.perf_counter() - start) / repeats[name]
            if round_:
                times[name].append(elapsed)
            elif min_sample_s > 0:
                repeats[name] = max(1, math.ceil(min_sample_s / max(elapsed, 1e-6)))
    return {name: Timing.of(t) for name, t in times.items()}


def interleaved_medians(
    fns: dict[str, Callable[[], object]], runs: int, sync: Callable[[], None] = lambda: None
) -> dict[str, float]:
    """Median seconds of each function (see ``interleaved_timings``)."""
    return {name: t.median for name, t in interleaved_timings(fns, runs, sync).items()}


def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else float("inf")


def print_json_rows(rows: Sequence[dict[str, Any]]) -> None:
    for row in rows:
        print(json.dumps(row, sort_keys=True))


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def emit(
    rows: Sequence[dict[str, Any]],
    as_json: bool,
    title: str,
    columns: Sequence[tuple[str, str, str]],
    stores: bool = False,
) -> None:
    """Print the rows: one JSON object per line, or a title and a table; ``stores``: then say
    (on stderr) which stores kvtier's native copies chose in this process."""
    if as_json:
        print_json_rows(rows)
    else:
        print(title)
        print_table(rows, columns)
    if stores:
        progress(stores_line())


def save_plot(path: str, draw: Callable[[Any], None], title: str) -> None:
    """Draw a figure with ``draw(pyplot)`` and save it to ``path`` (PNG, SVG, PDF by suffix).

    matplotlib is an optional extra: ``pip install 'kvtier[plot]'``.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'kvtier[plot]'") from None
    plt.figure(figsize=(10, 5.5))
    draw(plt)
    plt.suptitle(title)
    plt.tight_layout()
    plt.savefig(path, dpi=110)
    plt.close("all")
    progress(f"plot written to {path}")


def log2_axes(ax, ticks: Sequence, labels: Sequence[str], xlabel: str, ylabel: str, title: str):
    """The sweep plots' axes: a log2 x axis ticked at ``ticks``, y from 0, grid and legend."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, labels)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def standalone(
    name: str,
    doc: str | None,
    add_arguments: Callable,
    report: Callable,
    argv: Sequence[str] | None = None,
) -> int:
    """``python -m kvtier_bench.NAME``: the same options as ``kvtier bench NAME``."""

    from kvtier.ops.cli_args import Parser

    parser = Parser(prog=f"kvtier bench {name}", description=doc)
    add_arguments(parser)
    return report(parser.parse_args(argv))


def stores_line() -> str:
    """Which stores kvtier's native copies chose in this process (``kvtier.memory.stores``)."""
    try:
        from kvtier import _copy
    except ImportError:
        return "kvtier's native copier is not built"
    from kvtier.memory import stores

    return "kvtier's native copies: " + stores.choice(_copy).describe()
