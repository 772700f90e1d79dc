"""`kvtier store stats|verify|gc`: look at and tidy a store without writing Python.

The file store can be listed, so all three work on it; so can an s3 store, named
``s3://bucket/prefix`` with ``--endpoint`` (or ``$AWS_ENDPOINT_URL``) and its credentials
(``--credentials-file``, or the usual ``AWS_*`` environment). Mooncake's client API cannot list or
read objects without knowing their keys: ``gc`` removes by namespace, version or fingerprint
there (its ``remove_by_regex``); ``stats``, ``verify``, ``--older-than``, ``--capacity`` and
``--dry-run`` need a file store and say so.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections import defaultdict
from typing import Any

from kvtier.errors import ConfigError
from kvtier.ops.cli_args import DefaultsFormatter, byte_size, duration
from kvtier.ops.table import age, print_table, printable, size
from kvtier.storage import remove_matching
from kvtier.transport.auth import read_key


def add_store(sub, common: argparse.ArgumentParser) -> None:
    store = sub.add_parser(
        "store",
        parents=[common],
        help="inspect and manage a store (stats, verify, gc)",
        description="Inspect and manage a kvtier store. Safe while workers use it: a removed "
        "object is a miss for them, never an error.",
    )
    actions = store.add_subparsers(dest="store_action", required=True, metavar="ACTION")
    fmt = DefaultsFormatter

    stats = actions.add_parser(
        "stats",
        parents=[common],
        formatter_class=fmt,
        help="objects and bytes per namespace, weight version and layout",
    )
    stats.add_argument("root", help="file store directory, or s3://bucket/prefix")
    _s3_arguments(stats)
    stats.add_argument("--json", action="store_true", help="one JSON object per group")
    stats.set_defaults(func=_stats)

    verify = actions.add_parser(
        "verify",
        parents=[common],
        formatter_class=fmt,
        help="check every object's header and payload",
    )
    verify.add_argument("root", help="file store directory, or s3://bucket/prefix")
    _s3_arguments(verify)
    verify.add_argument("--repair", action="store_true", help="remove corrupt objects (only)")
    verify.add_argument("--mac-key-file", help="also check MACs of authenticated objects")
    verify.add_argument("--json", action="store_true", help="print the summary as JSON")
    verify.set_defaults(func=_verify)

    _add_gc(actions, common)


def _add_gc(actions, common: argparse.ArgumentParser) -> None:
    fmt = DefaultsFormatter
    gc = actions.add_parser(
        "gc",
        parents=[common],
        formatter_class=fmt,
        help="remove objects by namespace, version, layout, age or down to a capacity",
        description="Remove the objects that match every given criterion; then, with "
        "--capacity, the least recently used of the rest until the store fits.",
    )
    gc.add_argument(
        "root", nargs="?", help="file store directory, s3://bucket/prefix (or --mooncake-master)"
    )
    _s3_arguments(gc)
    gc.add_argument("--namespace", action="append", default=[], help="repeatable")
    gc.add_argument("--version", action="append", default=[], help="weight version; repeatable")
    gc.add_argument("--fingerprint", action="append", default=[], help="layout; repeatable")
    gc.add_argument(
        "--older-than", type=duration, help="last used longer ago than this: 90s, 30m, 12h, 7d"
    )
    gc.add_argument(
        "--capacity", type=byte_size(0), help="then evict LRU down to this size: 500M, 10G"
    )
    gc.add_argument("--dry-run", action="store_true", help="show what would go, remove nothing")
    gc.add_argument("--mooncake-master", help="host:port: gc a Mooncake store instead")
    gc.add_argument("--mooncake-metadata", help="that master's metadata server URL")
    gc.add_argument("--json", action="store_true", help="print the summary as JSON")
    gc.set_defaults(func=_gc)


# ---- stats --------------------------------------------------------------------------------------

STATS_COLUMNS = [
    ("namespace", "namespace", "s"),
    ("version", "version", "s"),
    ("fingerprint", "layout", "s"),
    ("ranks", "ranks", "s"),
    ("objects", "objects", ",d"),
    ("size", "size", "s"),
    ("last_used", "last used", "s"),
]


def _s3_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", help="an s3 store's server: http(s)://host:port")
    p.add_argument("--credentials-file", help="an s3 store's keys: a 0600 file (AWS form)")


class _FileTarget:
    """A file store's admin tools, as an s3 store's (``S3Target``) are called."""

    def __init__(self, root: str) -> None:
        # local: the file store's admin tools load only for the subcommands that use them
        from kvtier.storage import file_admin

        self.root, self.admin = root, file_admin
        self.tree = file_admin.StoreTree(root)  # held open while the command runs

    def scan(self) -> list:
        return list(self.tree.scan())

    def verify_all(self, objects: list, mac_key: bytes | None, progress) -> list:
        return self.admin.verify_all(objects, mac_key, progress)

    def remove(self, found) -> bool:
        return self.admin.remove(found)


def _target(args: argparse.Namespace):
    if args.root.startswith("s3://"):
        # local: obstore and the s3 backend load only for an s3 store
        from kvtier.storage import s3_admin

        return s3_admin.S3Target(args.root, args.endpoint, args.credentials_file)
    return _FileTarget(args.root)


def _where(found, root: str) -> str:
    path = found.path
    return printable(str(path if root.startswith("s3://") else path.relative_to(root)))


def _stats(args: argparse.Namespace) -> int:
    objects = _target(args).scan()
    groups: dict[tuple[str, str, str], list] = defaultdict(list)
    for o in objects:
        if not o.foreign and not o.problem:
            groups[(o.namespace, o.version, o.fingerprint)].append(o)
    now = time.time()
    rows = []
    for (namespace, version, fingerprint), members in sorted(groups.items()):
        ranks = sorted({o.parts.rank for o in members if o.parts})
        total = sum(o.size for o in members)
        rows.append(
            {
                "namespace": namespace,
                "version": version,
                "fingerprint": fingerprint,
                "ranks": _ranks(ranks),
                "objects": len(members),
                "bytes": total,
                "size": size(total),
                "last_used": age(now - max(o.mtime for o in members)) + " ago",
                "last_used_s": round(now - max(o.mtime for o in members), 3),
                "last_used_unix": float(max(o.mtime for o in members)),
            }
        )
    bad = [o for o in objects if o.problem and not o.foreign]
    foreign = [o for o in objects if o.foreign]
    if args.json:  # numbers for programs: seconds and bytes, not "2s ago" and "1.2 MiB"
        for row in rows:
            row.pop("size")
            row.pop("last_used")
            print(json.dumps(row))
        print(
            json.dumps(
                {
                    "total_objects": sum(r["objects"] for r in rows),
                    "bad_headers": len(bad),
                    "foreign": len(foreign),
                }
            )
        )
        return 0
    count, total = sum(r["objects"] for r in rows), sum(r["bytes"] for r in rows)
    print(f"kvtier store stats {args.root}: {count:,} objects, {size(total)}")
    for row in rows:  # the table shows the empty version as "" (JSON carries the value)
        row["version"] = row["version"] or '""'

    print_table(rows, STATS_COLUMNS)
    if bad or foreign:
        print(
            f"also: {len(bad)} object(s) whose header does not check out, {len(foreign)} foreign "
            f"entr{'y' if len(foreign) == 1 else 'ies'} (`kvtier store verify` lists them)"
        )
    return 0


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "?"
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1:
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


# ---- verify -------------------------------------------------------------------------------------


def _verify(args: argparse.Namespace) -> int:
    mac_key = None
    if args.mac_key_file:
        mac_key = read_key(args.mac_key_file, "mac_key_file")
    target = _target(args)
    objects = target.scan()
    own = [o for o in objects if not o.foreign]
    bar = None if args.json else Progress("verifying", "objects")
    target.verify_all(own, mac_key, bar.update if bar else None)
    if bar:
        bar.done()
    corrupt = [o for o in own if o.problem]
    foreign = [o for o in objects if o.foreign]
    removed = sum(target.remove(o) for o in corrupt) if args.repair else 0
    summary: dict[str, Any] = {
        "sound": len(own) - len(corrupt),
        "corrupt": len(corrupt),
        "foreign": len(foreign),
        "removed": removed,
        "problems": [{"path": str(o.path), "problem": o.problem} for o in corrupt + foreign],
    }
    if args.json:
        print(json.dumps(summary))
    else:
        print(
            f"kvtier store verify {args.root}: {summary['sound']:,} sound, "
            f"{summary['corrupt']:,} corrupt, {summary['foreign']:,} foreign"
            + (f"; removed {removed:,} corrupt" if args.repair else "")
        )
        for o in (corrupt + foreign)[:20]:
            kind = "foreign" if o.foreign else "corrupt"
            where = _where(o, args.root)
            print(f"  {kind}: {where}: {printable(o.problem or '')}")
        if len(corrupt) + len(foreign) > 20:
            print(f"  ... and {len(corrupt) + len(foreign) - 20} more (--json lists all)")
        if corrupt and not args.repair:
            print("run again with --repair to remove the corrupt objects (foreign files are kept)")
    return 1 if corrupt and not args.repair else 0


class Progress:
    """A one-line progress bar on stderr, redrawn in place when stderr is a terminal."""

    def __init__(self, what: str, unit: str) -> None:
        self.what, self.unit = what, unit
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def update(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self._last < (0.1 if self.tty else 2.0):
            return
        self._last = now
        width = 30
        filled = width * done // max(total, 1)
        line = (
            f"{self.what} [{'#' * filled}{'.' * (width - filled)}] {done:,}/{total:,} {self.unit}"
        )
        print(
            ("\r" + line) if self.tty else line,
            end="" if self.tty else "\n",
            file=sys.stderr,
            flush=True,
        )

    def done(self) -> None:
        if self.tty:
            print(file=sys.stderr)


# ---- gc -----------------------------------------------------------------------------------------


def _gc(args: argparse.Namespace) -> int:
    if args.mooncake_master:
        return _gc_mooncake(args)
    if not args.root:
        raise ConfigError("root", "give a file store directory, or --mooncake-master HOST:PORT")
    # local: the file store's admin tools load only for the subcommands that use them
    from kvtier.storage import file_admin

    older, capacity = args.older_than, args.capacity  # parsed by the options' types
    selection = file_admin.Selection(
        frozenset(args.namespace),
        frozenset(args.version),
        frozenset(args.fingerprint),
        older,
        capacity,
    )
    target = _target(args)
    chosen = file_admin.select(target.scan(), selection)
    removed = 0 if args.dry_run else sum(target.remove(o) for o, _ in chosen)
    freed = sum(o.size for o, _ in chosen)
    by_reason: dict[str, int] = defaultdict(int)
    for _, reason in chosen:
        by_reason[reason] += 1
    summary = {
        "selected": len(chosen),
        "removed": removed,
        "bytes": freed,
        "dry_run": args.dry_run,
        **by_reason,
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    count = len(chosen) if args.dry_run else removed
    reasons = ", ".join(f"{n:,} {r}" for r, n in by_reason.items()) or "nothing matched"
    print(f"kvtier store gc {args.root}: {verb} {count:,} objects, {size(freed)} ({reasons})")
    return 0


def _gc_mooncake(args: argparse.Namespace) -> int:
    unsupported = [
        f"--{name.replace('_', '-')}"
        for name in ("older_than", "capacity", "dry_run")
        if getattr(args, name) not in (None, False)
    ]
    if unsupported:
        raise ConfigError(
            unsupported[0].lstrip("-").replace("-", "_"),
            "Mooncake cannot list its objects: on Mooncake, gc removes by --namespace, "
            "--version and --fingerprint only",
        )
    if not (args.namespace or args.version or args.fingerprint):
        raise ConfigError(
            "namespace", "say what to remove: --namespace, --version or --fingerprint"
        )

    pattern = key_pattern(args.namespace, args.version, args.fingerprint)
    config = {"master_address": args.mooncake_master}
    if args.mooncake_metadata:
        config["metadata_server"] = args.mooncake_metadata
    removed = remove_matching(config, pattern)
    if args.json:
        print(json.dumps({"removed": removed, "pattern": pattern}))
    else:
        print(f"kvtier store gc {args.mooncake_master}: removed {removed:,} objects ({pattern})")
    return 0


def key_pattern(namespaces: list[str], versions: list[str], fingerprints: list[str]) -> str:
    """The regular expression for storage keys ``kv1:ns:version:fingerprint:...`` in the sets
    given (an empty list matches anything there)."""

    def one_of(values: list[str]) -> str:
        return "(" + "|".join(re.escape(v) for v in values) + ")" if values else "[^:]*"

    return f"^kv1:{one_of(namespaces)}:{one_of(versions)}:{one_of(fingerprints)}:"
