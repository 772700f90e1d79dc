"""`kvtier bench e2e`: the demo's multi-turn chat workload under three configurations, one run.

(a) device-only prefix caching, (b) device + host without storage, (c) kvtier with host and
storage. Reports where prefill tokens came from, the share of prefill avoided, and the time
spent in kvtier per request.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from collections.abc import Sequence

from kvtier.demo import Workload, run
from kvtier_bench.common import emit, progress, standalone

COLUMNS = [
    ("config", "configuration", "s"),
    ("device", "device", ".1%"),
    ("host", "host", ".1%"),
    ("storage", "storage", ".1%"),
    ("compute", "recomputed", ".1%"),
    ("prefill_avoided", "prefill avoided", ".1%"),
    ("kvtier_ms_per_request", "kvtier ms/request", ".2f"),
]
CONFIGS = [
    ("device only", False, False),
    ("device + host", True, False),
    ("kvtier: device + host + storage", True, True),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--device-blocks", type=int, default=160)
    p.add_argument("--host-blocks", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")


def run_all(args: argparse.Namespace) -> list[dict]:
    w = Workload.from_args(args)
    rows = []
    for name, use_host, use_storage in CONFIGS:
        progress(f"{name} ...")
        root = tempfile.mkdtemp(prefix="kvtier-e2e-")
        try:
            r = run(
                w,
                {"backend": "file", "root": root},
                args.ranks,
                use_host=use_host,
                use_storage=use_storage,
                progress=False,
            )
        finally:
            shutil.rmtree(root, ignore_errors=True)
        total = max(1, r["prefill_tokens"])
        rows.append(
            {
                "config": name,
                **{k: v / total for k, v in r["tokens"].items()},
                "prefill_avoided": r["prefill_avoided"],
                "kvtier_ms_per_request": r["kvtier_ms_per_request"],
                "requests": r["requests"],
                "prefill_tokens": r["prefill_tokens"],
                "blocks_verified": r["blocks_verified"],
                "blocks_checked": r["blocks_checked"],
            }
        )
    return rows


def report(args: argparse.Namespace) -> int:
    rows = run_all(args)
    title = (
        f"kvtier bench e2e ({args.users} users x {args.turns} turns, {args.ranks} ranks, "
        f"device {args.device_blocks} blocks, host {args.host_blocks} blocks)"
    )
    emit(rows, args.json, title, COLUMNS)
    return 0 if all(r["blocks_verified"] == r["blocks_checked"] for r in rows) else 1


def main(argv: Sequence[str] | None = None) -> int:
    return standalone("e2e", __doc__, add_arguments, report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
