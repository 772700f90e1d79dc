"""`kvtier bench e2e`: the demo's multi-turn chat workload under three configurations.

(a) device-only prefix caching, (b) device + host without storage, (c) kvtier with host and
storage. Reports where prefill tokens came from, the share of prefill avoided, and the time
spent in kvtier per request (median and spread of ``--runs`` runs; the token shares are the
same every run: the workload is seeded).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from collections.abc import Sequence

from kvtier.ops.demo import Workload, run
from kvtier.ops.table import plural
from kvtier_bench.common import emit, progress, save_plot, standalone
from kvtier_bench.options import e2e_arguments as add_arguments

COLUMNS = [
    ("config", "configuration", "s"),
    ("device", "device", ".1%"),
    ("host", "host", ".1%"),
    ("storage", "storage", ".1%"),
    ("compute", "recomputed", ".1%"),
    ("prefill_avoided", "prefill avoided", ".1%"),
    ("kvtier_ms_per_request", "kvtier ms/request", ".2f"),
    ("ms_range", "min-max", "s"),
]
CONFIGS = [
    ("device only", False, False),
    ("device + host", True, False),
    ("kvtier: device + host + storage", True, True),
]


def run_all(args: argparse.Namespace) -> list[dict]:
    w = Workload.from_args(args)
    rows = []
    for name, use_host, use_storage in CONFIGS:
        runs = []
        for i in range(max(1, args.runs)):
            progress(f"{name} (run {i + 1} of {max(1, args.runs)}) ...")
            root = tempfile.mkdtemp(prefix="kvtier-e2e-")
            try:
                runs.append(
                    run(
                        w,
                        {"backend": "file", "root": root},
                        args.ranks,
                        use_host=use_host,
                        use_storage=use_storage,
                        progress=False,
                    )
                )
            finally:
                shutil.rmtree(root, ignore_errors=True)
        r = runs[0]
        ms = [x["kvtier_ms_per_request"] for x in runs]
        total = max(1, r["prefill_tokens"])
        rows.append(
            {
                "config": name,
                **{k: v / total for k, v in r["tokens"].items()},
                "prefill_avoided": r["prefill_avoided"],
                "kvtier_ms_per_request": statistics.median(ms),
                "ms_range": f"{min(ms):.2f}-{max(ms):.2f}",
                "requests": r["requests"],
                "prefill_tokens": r["prefill_tokens"],
                "blocks_verified": sum(x["blocks_verified"] for x in runs),
                "blocks_checked": sum(x["blocks_checked"] for x in runs),
                "runs": len(runs),
            }
        )
    return rows


def report(args: argparse.Namespace) -> int:
    rows = run_all(args)
    title = (
        f"kvtier bench e2e ({plural(args.users, 'user')} x {plural(args.turns, 'turn')}, "
        f"{plural(args.ranks, 'rank')}, "
        f"device {args.device_blocks} blocks, host {args.host_blocks} blocks)"
    )
    emit(rows, args.json, title, COLUMNS)
    note = working_set_note(rows, Workload.from_args(args))
    if note and not args.json:
        print(note)
    if args.plot:
        save_plot(args.plot, lambda plt: plot(plt, rows), title)
    return 0 if all(r["blocks_verified"] == r["blocks_checked"] for r in rows) else 1


def working_set_note(rows: list[dict], w: Workload) -> str:
    """When every configuration served the same shares, the device cache held everything."""
    shares = {tuple(round(r[k], 6) for k in ("device", "host", "storage")) for r in rows}
    if len(shares) > 1:
        return ""
    need = w.working_set_blocks()
    return (
        f"note: the three rows are the same because the device cache ({w.device_blocks} blocks) "
        f"holds the whole working set ({need} blocks): host and storage are never needed. "
        f"Use --device-blocks below {need} (or more --users) to see them work."
    )


def plot(plt, rows: list[dict]) -> None:
    """Where each configuration's prefill tokens came from, as stacked bars."""
    tiers = [("device", "device cache"), ("host", "host pool"), ("storage", "storage")]
    tiers.append(("compute", "recomputed"))
    names = [r["config"] for r in rows]
    left = [0.0] * len(rows)
    for key, label in tiers:
        values = [r[key] * 100 for r in rows]
        plt.barh(names, values, left=left, label=label)
        left = [a + b for a, b in zip(left, values)]
    plt.xlabel("share of prefill tokens (%)")
    plt.xlim(0, 100)
    plt.gca().invert_yaxis()
    plt.legend(loc="lower right", fontsize=8)


def main(argv: Sequence[str] | None = None) -> int:
    return standalone("e2e", __doc__, add_arguments, report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
