"""``kvtier bench serve --tiered``'s figures, without a server: the memory tier's server divided by
the kvtier server round by round (issue 30's (e)), not by the no-connector server, and the median
of those ratios, not a ratio of medians."""

from __future__ import annotations

import statistics

from kvtier_bench.serve import SHOWN, print_tiered, rows_of


def _figures(seen_p50_s: float) -> dict:
    every = {figure: 1.0 for figure, _, _ in SHOWN}
    return {
        **every,
        "seen_ttft_p50_s": seen_p50_s,
        "tokens": [[1, 2]],
        "seen": [True],
        "load_average": 1.0,
    }


def _round(plain: float, kvtier: float, tiered: float | None) -> dict:
    entry = {"plain": {"w": _figures(plain)}, "kvtier": {"w": _figures(kvtier)}}
    if tiered is not None:
        entry["tiered"] = {"w": _figures(tiered)}
    return entry


def test_the_memory_tier_is_divided_by_the_store_alone_in_its_own_round(capsys) -> None:
    rounds = [_round(0.6, 0.2, 0.05), _round(0.7, 0.4, 0.04), _round(0.5, 0.25, 0.1)]
    rows = rows_of(rounds, {"w": None})
    seen = next(r for r in rows if r.get("figure") == "seen_ttft_p50_s")
    assert seen["tiered_vs_kvtier_rounds"] == [(0.05, 0.2), (0.04, 0.4), (0.1, 0.25)]
    # Median of the per-round ratios (0.25, 0.1, 0.4): 0.25, where medians' ratio is 0.05/0.25.
    assert seen["tiered_vs_kvtier"] == 0.25
    # Beside it, as for every extra server: ÷ the no-connector server of the same round.
    assert seen["tiered_ratio"] == statistics.median([0.05 / 0.6, 0.04 / 0.7, 0.1 / 0.5])
    print_tiered(rows)
    out = capsys.readouterr().out
    assert "0.250 (50/200)  0.100 (40/400)  0.400 (100/250)" in out


def test_rounds_without_the_tiered_server_add_no_tiered_figures(capsys) -> None:
    rows = rows_of([_round(0.6, 0.2, None)], {"w": None})
    assert not any("tiered_vs_kvtier" in r for r in rows)
    print_tiered(rows)
    assert capsys.readouterr().out == ""


def _server(label: str, run: int, ttfts: list[float]) -> dict:
    from kvtier_bench.reuse import COUNTERS

    return {
        "server": label,
        "round": run,
        "ttfts": ttfts,
        "generated": ["a"] * len(ttfts),
        "load_average": 1.0,
        "estimates": {"step_s": 0.05},
        **{k: 0 for k in COUNTERS},
    }


def test_bench_reuse_reports_tails_that_are_not_one_event_a_round(capsys) -> None:
    """Each round's p99 is its slowest request or so; the pooled p99 and the p99 after the first
    burst (the first ``concurrency`` requests, cold in both servers) are not."""
    from kvtier_bench.reuse import print_report, rows_of

    rounds = []
    for run in (1, 2):
        cold = [3.0, 2.0, 2.0]  # the first burst: slow in both
        rounds.append(
            {
                "plain": _server("plain", run, cold + [1.0] * 45),
                "kvtier": _server("kvtier", run, [4.0, 2.0, 2.0] + [0.5] * 45),
            }
        )
    rows = rows_of(rounds, burst=3)
    first = rows[0]
    assert first["ratio_ttft_p99_s"] > 1.0  # the first request alone decides it
    assert first["ratio_ttft_p99_after_first_burst_s"] == 0.5
    assert first["ratio_ttft_p50_s"] == 0.5 and first["same_completions"]
    pooled = rows[-1]
    assert pooled["round"] == "pooled" and pooled["ratio_ttft_p50_s"] == 0.5
    print_report(rows)
    assert "pooled over rounds" in capsys.readouterr().out
