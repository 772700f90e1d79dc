"""``kvtier bench cluster``'s table: medians over rounds of each figure and of its ratio."""

from __future__ import annotations

import statistics
from typing import Any

from kvtier.ops.table import print_table
from kvtier_bench.common import gbps

COLUMNS = [
    ("part", "", "s"),
    ("measure", "measure", "s"),
    ("value", "value", ".3f"),
    ("baseline", "baseline", ".3f"),
    ("ratio", "ratio", ".3f"),
    ("goal", "goal", "s"),
]


def rows_of(shared: list[dict], pd: list[dict], raw: dict[str, float]) -> list[dict[str, Any]]:
    """Medians over rounds of each figure and of its ratio to the baseline within a round."""

    def row(part, measure, pairs, goal=""):
        pairs = [(x, y) for x, y in pairs if x is not None and y]
        if not pairs:
            return None
        return {
            "part": part,
            "measure": measure,
            "value": statistics.median(x for x, _ in pairs),
            "baseline": statistics.median(y for _, y in pairs),
            "ratio": statistics.median(x / y for x, y in pairs),
            "goal": goal,
            "rounds": len(pairs),
        }

    s = [(r["shared"], r["alone"]) for r in shared]
    load_gbps = [
        gbps(int(x["load_bytes"]), x["load_microseconds"] / 1e6) if x["load_microseconds"] else None
        for x, _ in s
    ]
    # The same loads less their threads' waits for a core: what B's loads would move on a host
    # whose cores the engines did not take from them.
    own_s = [(x["load_microseconds"] - x.get("load_core_wait_microseconds", 0)) / 1e6 for x, _ in s]
    own_gbps = [gbps(int(x["load_bytes"]), t) if t > 0 else None for (x, _), t in zip(s, own_s)]
    busy = [r.get("raw_busy_gbps") for r in shared]  # each round's own get beside B serving
    rows = [
        row("B with A's prefixes / B alone", "TTFT mean (s)", _pairs(s, "ttft_mean_s")),
        row("B with A's prefixes / B alone", "TTFT p50 (s)", _pairs(s, "ttft_p50_s"), "<= 0.3"),
        row("B with A's prefixes / B alone", "TTFT p99 (s)", _pairs(s, "ttft_p99_s")),
        row("B with A's prefixes / B alone", "requests/s", _pairs(s, "requests_per_s")),
        row("B loads / raw get, idle machine", "GB/s", [(g, raw.get("idle")) for g in load_gbps]),
        row("B loads / raw get, B serving", "GB/s", list(zip(load_gbps, busy))),
        row("B loads less core waits / raw get, B serving", "GB/s", list(zip(own_gbps, busy))),
        row("P/D consumer / single", "TTFT p50 (s)", _pd(pd, "consumer"), "<= 0.3"),
        row("P/D producer + consumer / single", "TTFT p50 (s)", _pd(pd, "pd")),
    ]
    proxy = [(r["proxy"], r["single"]) for r in pd]
    rows += [
        row("P/D via pd-proxy / single", "TTFT p50 (s)", _pairs(proxy, "ttft_p50_s")),
        row("P/D via pd-proxy / single", "TTFT p99 (s)", _pairs(proxy, "ttft_p99_s")),
        row("P/D via pd-proxy / single", "requests/s", _pairs(proxy, "requests_per_s")),
    ]
    rows = [r for r in rows if r is not None]
    rows.append(_checks(shared, pd))
    return rows


def _checks(shared: list[dict], pd: list[dict]) -> dict[str, Any]:
    def total(figure: str, of: str | None = None) -> float:
        return sum((r[of] if of else r).get(figure, 0) for r in shared)

    return {
        "part": "checks",
        "hit_fraction_median": statistics.median(r["hit_fraction"] for r in shared)
        if shared
        else None,
        "failed_tokens": total("failed_tokens", "shared"),
        # Below 100 %: B declined, or did not find (A unsaved, failed, or not yet stored)
        "found_tokens": total("found_tokens", "shared"),
        "declined_tokens": total("declined_tokens", "shared"),
        "a_unsaved_tokens": total("a_unsaved_tokens"),
        "a_save_failures": total("a_save_failures"),
        # Seconds from A's last answer until its saves were stored, per round
        "a_saves_wait_s": [round(r.get("a_saves_wait_s", 0), 2) for r in shared],
        "a_saves_stored_rounds": sum(bool(r.get("a_saves_stored")) for r in shared),
        "identical_rounds_shared": sum(r["identical"] for r in shared),
        "identical_rounds_pd": sum(r["identical"] for r in pd),
        "rounds_shared": len(shared),
        "rounds_pd": len(pd),
        "load_average": [round(r["proxy"]["load_average"], 1) for r in pd]
        or [round(r["shared"]["load_average"], 1) for r in shared],
    }


def _pairs(pairs: list[tuple[dict, dict]], figure: str) -> list[tuple[Any, Any]]:
    return [(x.get(figure), y.get(figure)) for x, y in pairs]


def _pd(pd: list[dict], which: str) -> list[tuple[Any, Any]]:
    return [(r[f"{which}_ttft_p50_s"], r["single_ttft_p50_s"]) for r in pd]


def print_report(rows: list[dict], args) -> None:
    print(
        f"kvtier bench cluster: {args.rounds} rounds, {args.prompts} prompts x "
        f"{args.prompt_tokens} tokens per set, {args.concurrency} in flight, one Mooncake "
        f"master and storage node on loopback, engines as pure clients "
        f"({'checksums only' if args.no_mac else 'one MAC key'}); P/D through "
        f"{'the cluster' if args.pd_storage == 'mooncake' else 'a shared file store'}"
    )
    print_table([r for r in rows if "measure" in r], COLUMNS)
    c = rows[-1]
    identical = [
        f"{part} {c[f'identical_rounds_{key}']}/{c[f'rounds_{key}']} rounds"
        for part, key in (("shared", "shared"), ("P/D", "pd"))
        if c[f"rounds_{key}"]
    ]
    print(
        f"B's block-aligned prompt tokens from the store: {c['hit_fraction_median'] or 0:.0%} "
        f"(median; found {c['found_tokens']:.0f}, declined {c['declined_tokens']:.0f}; "
        f"A left {c['a_unsaved_tokens']:.0f} unsaved, {c['a_save_failures']:.0f} saves failed, "
        f"its saves stored in {c['a_saves_stored_rounds']} of {c['rounds_shared']} rounds, "
        f"after {c['a_saves_wait_s']} s), "
        f"failed tokens {c['failed_tokens']:.0f}; completions identical: "
        f"{', '.join(identical)}; load average {c['load_average']}"
    )
