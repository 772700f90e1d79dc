"""`kvtier status`: what a running instance's workers are doing, rank by rank.

Connects as an *observer*: a worker answers its ``stats`` requests and nothing else, and an
observer never counts as the engine (a worker whose engine is gone still exits on time while
``status --watch`` runs).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any

from kvtier.errors import ConfigError, KvtierError
from kvtier.ops.cli_args import DefaultsFormatter, positive_number
from kvtier.ops.table import age, render, size
from kvtier.worker.stats import tier_rows

COLUMNS = [
    ("rank", "rank", "d"),
    ("state", "state", "s"),
    ("version", "version", "s"),
    ("namespace", "namespace", "s"),
    ("fingerprint", "layout", "s"),
    ("in_flight", "in flight", "d"),
    ("queued", "queued", "d"),
    ("tasks", "tasks", ",d"),
    ("moved", "moved", "s"),
    ("hit_rate", "storage hits", "s"),
    ("corrupt", "corrupt", ",d"),
    ("errors", "errors", ",d"),
    ("uptime", "uptime", "s"),
]


def add_status(sub, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "status",
        parents=[common],
        help="state, weight version, queues and counters of a running instance's workers",
        description="Ask each worker of a running instance for its state and counters. Give the "
        "instance id (its ipc:// sockets are found) or the endpoints in rank order.",
        formatter_class=DefaultsFormatter,
    )
    p.add_argument("instance", nargs="?", help="instance id of the engine's workers")
    p.add_argument(
        "--endpoint",
        action="append",
        default=[],
        type=endpoint_address,
        help="a worker endpoint (ipc:///PATH or tcp://HOST:PORT); repeatable",
    )
    p.add_argument("--auth-key-file", help="the instance secret, for tcp:// endpoints")
    p.add_argument(
        "--watch",
        type=positive_number,
        nargs="?",
        const=2.0,
        metavar="SECONDS",
        help="refresh in place every SECONDS (2 when given alone) until Ctrl-C",
    )
    p.add_argument(
        "--timeout", type=positive_number, default=10.0, help="seconds to wait for answers"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per rank")
    p.set_defaults(func=_status)


def find_endpoints(instance: str) -> list[str]:
    """The ipc:// endpoints of ``instance``'s workers, in rank order."""
    from kvtier.worker.config import default_socket_dir

    directory = default_socket_dir()
    pattern = re.compile(re.escape(instance) + r"-rank(\d+)\.sock")
    ranks = sorted(
        (int(m.group(1)), p) for p in directory.iterdir() if (m := pattern.fullmatch(p.name))
    )
    if not ranks:
        raise ConfigError(
            "instance",
            f"no worker sockets of instance {instance!r} in {directory}: is it running? "
            "(or give its endpoints with --endpoint)",
        )
    return [f"ipc://{path}" for _, path in ranks]


def collect(client, timeout_s: float) -> list[dict[str, Any]]:
    """Each rank's ``stats``, in rank order."""
    answer = client.control("stats", timeout_s=timeout_s)
    return [dict(answer.per_rank[r].data) for r in sorted(answer.per_rank)]


def row(stats: dict[str, Any]) -> dict[str, Any]:
    """The table row of one rank's stats."""
    tasks = stats.get("tasks", {})
    storage = stats.get("storage", {})
    hits, misses = storage.get("hits", 0), storage.get("misses", 0)
    queued = sum(stats.get("queue_depths", {}).values()) + stats.get("held", 0)
    return {
        "rank": stats["rank"],
        "state": stats["state"],
        "version": (stats.get("weight_version") or '""')
        + (" (pinned)" if stats.get("version_pinned") else ""),
        "namespace": stats.get("namespace", "?"),
        "fingerprint": stats.get("fingerprint", "?"),
        "in_flight": stats.get("in_flight", 0),
        "queued": queued,
        "tasks": sum(c.get("tasks", 0) for c in tasks.values()),
        "moved": size(sum(c.get("bytes", 0) for c in tasks.values())),
        "hit_rate": f"{hits}/{hits + misses}" if hits + misses else "-",
        "corrupt": storage.get("corrupt", 0),
        "errors": sum(stats.get("errors", {}).values()),
        "uptime": age(stats.get("uptime_s", 0)),
    }


def screen(stats: list[dict[str, Any]], title: str) -> list[str]:
    lines = [title, *render([row(s) for s in stats], COLUMNS)]
    per_kind: dict[str, dict[str, int]] = {}
    for s in stats:
        for kind, c in s.get("tasks", {}).items():
            k = per_kind.setdefault(kind, {"tasks": 0, "bytes": 0, "microseconds": 0})
            for field in k:
                k[field] += c.get(field, 0)
    if per_kind:
        lines.append("")
        kinds = [
            {
                "kind": kind,
                "tasks": c["tasks"],
                "moved": size(c["bytes"]),
                "mean_ms": c["microseconds"] / 1000 / max(c["tasks"], 1),
            }
            for kind, c in sorted(per_kind.items())
        ]
        cols = [("kind", "task", "s"), ("tasks", "count", ",d"), ("moved", "moved", "s")]
        lines += render(kinds, [*cols, ("mean_ms", "mean ms", ".2f")])
    tiers = [row for s in stats for row in tier_rows(s)]
    if tiers:
        lines += ["", *render(tiers, TIER_COLUMNS)]
    return lines


TIER_COLUMNS = [
    ("rank", "rank", "d"),
    ("tier", "tier", "d"),
    ("backend", "backend", "s"),
    ("hits", "hits", ",d"),
    ("misses", "misses", ",d"),
    ("corrupt", "corrupt", ",d"),
    ("evictions", "evicted", ",d"),
    ("promotions", "promoted", ",d"),
    ("written", "written down", ",d"),
    ("pending_writes", "pending", ",d"),
    ("unavailable", "down", ",d"),
]


def _status(args: argparse.Namespace) -> int:
    from kvtier.engine.client import Client

    endpoints = args.endpoint or (find_endpoints(args.instance) if args.instance else [])
    if not endpoints:
        raise ConfigError("instance", "give the instance id or --endpoint (see --help)")
    client = Client.connect(
        endpoints, start_timeout_s=args.timeout, observer=True, auth_key_file=args.auth_key_file
    )
    name = args.instance or ", ".join(endpoints)
    try:
        while True:
            try:
                stats = collect(client, args.timeout)
            except KvtierError as e:
                raise ConfigError("instance", f"{name} did not answer: {e}") from None
            if args.json:
                for s in stats:
                    print(json.dumps(s, sort_keys=True), flush=True)
            else:
                when = time.strftime("%H:%M:%S")
                lines = screen(stats, f"kvtier status {name}: {len(stats)} rank(s), {when}")
                if args.watch and sys.stdout.isatty():
                    print("\x1b[H\x1b[2J", end="")  # home, clear: redraw in place
                print("\n".join(lines), flush=True)
            if not args.watch:
                return 0
            time.sleep(args.watch)
    finally:
        client.close()


ENDPOINT = re.compile(r"ipc:///.+|tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):\d{1,5}")


def endpoint_address(text: str) -> str:
    """A worker endpoint as the workers take them (argparse's check: one line when not)."""
    if not ENDPOINT.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a worker endpoint: ipc:///ABSOLUTE/PATH or tcp://HOST:PORT"
        )
    return text
