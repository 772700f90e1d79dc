"""The ``kvtier demo`` command around the workload (``kvtier.ops.demo``): its checks, its store
(a temporary file store, a memory store or Mooncake), its report. Leaves nothing behind unless
``--keep-store``, also when interrupted."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.common.interrupts import CleanupStack
from kvtier.common.user_dirs import open_user_directory
from kvtier.errors import ConfigError
from kvtier.ops.table import printable
from kvtier.storage import LocalMaster, LocalStoreNode, describe_backend, with_memory_tier
from kvtier.worker.config import check_instance_id

if TYPE_CHECKING:
    from kvtier.ops.demo import Workload

MAX_RANKS = 64
RANKS_PER_CORE = 4  # each rank is a process with its own threads: past this, it only crawls
PROBE_TIMEOUT_S = 3.0  # a Mooncake master on the given address must accept a connection by then


def check_demo_options(args: Any) -> None:
    """What ``kvtier demo`` refuses before it starts anything, each naming its option."""
    check_ranks(args.ranks)
    if args.instance_id is not None:
        check_instance_id(args.instance_id)
    for option in ("mooncake_master", "mooncake_metadata"):
        if getattr(args, option) and args.backend != "mooncake":
            flag = "--" + option.replace("_", "-")
            raise ConfigError(
                option,
                f"{flag} applies only with --backend mooncake (the backend is {args.backend})",
            )
    if getattr(args, "memory_tier", None) and args.backend == "memory":
        raise ConfigError(
            "memory_tier", "--memory-tier goes in front of --backend file or mooncake"
        )
    if args.keep_store is not None:
        if args.backend != "file":
            raise ConfigError("keep_store", f"keeps a file store; the backend is {args.backend}")
        check_keep_store(Path(args.keep_store))
    if args.mooncake_master:
        probe_master(args.mooncake_master)


def check_ranks(ranks: int) -> None:
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
        raise ConfigError("ranks", f"must be an integer in 1..{MAX_RANKS}, got {ranks!r}")
    cores = len(os.sched_getaffinity(0))
    if ranks > RANKS_PER_CORE * cores:
        raise ConfigError(
            "ranks",
            f"{ranks} ranks on {cores} CPU core{'s' if cores != 1 else ''}: each rank is a "
            f"worker process with its own threads; at most {RANKS_PER_CORE * cores} here "
            f"({RANKS_PER_CORE} per core)",
        )


def probe_master(address: str) -> None:
    """ConfigError unless something accepts a TCP connection at ``address`` (host:port)."""

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("mooncake_master", f"must be host:port, got {address!r}")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), PROBE_TIMEOUT_S):
            pass
    except OSError as e:
        raise ConfigError(
            "mooncake_master",
            f"nothing answers at {address} ({e.strerror or e}): start mooncake_master there, "
            "or leave --mooncake-master out to start one on loopback",
        ) from None


STORE_ENTRIES = frozenset({"objects", "tmp"})  # what a file store's root holds


def check_keep_store(path: Path) -> None:
    """``--keep-store`` takes a new or empty directory, or a kvtier file store (an earlier
    ``--keep-store``): never a directory of other things, which the store would write into, nor
    one another user controls (``kvtier.common.user_dirs``: checked before anything in it is read).
    Its parent must exist: a mistyped path is not made, parents and all."""
    parent = path.absolute().parent
    if not parent.is_dir():
        raise ConfigError(
            "keep_store",
            f"{parent} does not exist: create it first, or name a directory inside one that does",
        )
    try:
        fd, _ = open_user_directory(path, 0o700, "keep_store")
    except OSError as e:
        raise ConfigError("keep_store", f"cannot make or open {path}: {e.strerror}") from None
    try:
        entries = sorted(os.listdir(fd))
    except OSError as e:
        raise ConfigError("keep_store", f"cannot read {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    strangers = [name for name in entries if name not in STORE_ENTRIES]
    if strangers or (entries and "objects" not in entries):
        shown = ", ".join(printable(n) for n in (strangers or entries)[:3])
        raise ConfigError(
            "keep_store",
            f"{path} is not empty and not a kvtier file store (it holds {shown}"
            f"{', ...' if len(strangers) > 3 else ''}): give a new or empty directory, or one "
            "an earlier --keep-store made",
        )


def run_demo(
    w: Workload,
    backend: str,
    ranks: int,
    keep_store: str | None,
    mooncake: dict | None = None,
    write_policy: str = "write_through",
    progress: bool = True,
    instance_id: str | None = None,
    memory_tier: int | None = None,
) -> dict[str, Any]:
    """The demo: a file store in a temporary directory (or ``keep_store``), a memory store, or
    Mooncake (``mooncake`` options, or a master and storage node started on loopback). Leaves
    nothing behind unless ``keep_store``, also when interrupted."""
    from kvtier.ops.demo import run  # torch and numpy: only once the checks passed

    check_ranks(ranks)
    if keep_store is not None:
        check_keep_store(Path(keep_store))
    with CleanupStack() as stack:
        if backend == "file":
            root = keep_store or tempfile.mkdtemp(prefix="kvtier-demo-")
            if keep_store is None:
                stack.callback(shutil.rmtree, root, ignore_errors=True)
            storage: dict[str, Any] = {"backend": "file", "root": root}
        elif backend == "mooncake":
            storage = {
                "backend": "mooncake",
                **(mooncake or stack.enter_context(_local_mooncake())),
            }
        else:
            storage = {"backend": backend}
        if memory_tier:
            storage = with_memory_tier(storage, memory_tier)
        result = run(
            w, storage, ranks, write_policy=write_policy, progress=progress, instance_id=instance_id
        )
        result["backend"] = describe_backend(storage)
        if keep_store is not None:
            result["kept_store"] = os.path.abspath(keep_store)
        return result
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _local_mooncake():
    """A master and a 1 GiB storage node on loopback; the workers are pure clients."""

    with LocalMaster() as master, LocalStoreNode(master, 1 << 30):
        yield {
            "master_address": master.master_address,
            "metadata_server": master.metadata_server,
            "global_segment_size": 0,
        }


def print_demo(r: dict) -> None:
    tokens = r["tokens"]
    total = max(1, r["prefill_tokens"])
    requests = r["requests"]
    print(
        f"\n{requests} request{'s' if requests != 1 else ''}, {r['prefill_tokens']:,} prefill "
        f"tokens, {r['ranks']} rank{'s' if r['ranks'] != 1 else ''}, {r['wall_s']:.1f} s"
    )
    print(f"  {'served from':<16}{'tokens':>10}{'share':>9}")
    for tier, label in (
        ("device", "device cache"),
        ("host", "host pool"),
        ("storage", "storage"),
        ("compute", "recomputed"),
    ):
        print(f"  {label:<16}{tokens[tier]:>10,}{tokens[tier] / total:>9.1%}")
    print(f"  prefill avoided: {r['prefill_avoided']:.1%}")
    print(f"  {'direction':<16}{'MiB':>10}{'GB/s':>9}")
    for kind in ("swap_out", "swap_in", "save", "load", "save_host"):
        if kind in r["bytes"]:
            print(f"  {kind:<16}{r['bytes'][kind] / 2**20:>10.1f}{r['gbps'].get(kind, 0):>9.2f}")
    print(f"  time in kvtier per request: {r['kvtier_ms_per_request']:.2f} ms")
    print(f"  integrity: {r['blocks_verified']} of {r['blocks_checked']} blocks verified")
    if "kept_store" in r:
        print(f"  file store kept in {r['kept_store']} (kvtier store stats {r['kept_store']})")
