"""Shared benchmark helpers: timing medians, readable tables, JSON rows."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any


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


def interleaved_medians(
    fns: dict[str, Callable[[], object]], runs: int, sync: Callable[[], None] = lambda: None
) -> dict[str, float]:
    """Median seconds of each function, run in turn each round so that all of them see the same
    machine noise (these machines are shared). The first round warms up and is not counted."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(runs + 1):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def gbps(num_bytes: int, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else float("inf")


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, str]]) -> None:
    """``columns`` is (key, heading, format spec) for each column."""
    cells = [[format(row[key], fmt) for key, _, fmt in columns] for row in rows]
    headings = [heading for _, heading, _ in columns]
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
        for i, h in enumerate(headings)
    ]
    line = "  ".join(h.rjust(w) for h, w in zip(headings, widths))
    print(line)
    print("-" * len(line))
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths)))
    sys.stdout.flush()


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
) -> None:
    """Print the rows: one JSON object per line, or a title and a table."""
    if as_json:
        print_json_rows(rows)
    else:
        print(title)
        print_table(rows, columns)


def standalone(
    name: str,
    doc: str | None,
    add_arguments: Callable,
    report: Callable,
    argv: Sequence[str] | None = None,
) -> int:
    """``python -m kvtier_bench.NAME``: the same options as ``kvtier bench NAME``."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"kvtier bench {name}", description=doc)
    add_arguments(parser)
    return report(parser.parse_args(argv))
