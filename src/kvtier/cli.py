"""The `kvtier` command: demo, bench, inspect."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from kvtier.errors import KvtierError
from kvtier.spec import KVCacheSpec


def _demo(args: argparse.Namespace) -> int:
    """Serve a multi-turn chat workload through the index, the client and 2 worker ranks."""
    from kvtier.demo import Workload, run_demo

    w = Workload.from_args(args)
    if not args.json:
        print(
            f"kvtier demo: {args.users} users x {args.turns} turns sharing a "
            f"{w.system_tokens}-token system prompt; {args.ranks} worker ranks; device cache "
            f"{w.device_blocks} blocks, host {w.host_blocks} blocks, storage: {args.backend}",
            file=sys.stderr,
            flush=True,
        )
    with _mooncake_for(args) as mooncake:
        result = run_demo(
            w,
            args.backend,
            args.ranks,
            args.keep_store,
            mooncake,
            args.write_policy,
            progress=not args.json,
        )
    if args.json:
        print(json.dumps(result))
    else:
        _print_demo(result, w.block_size)
    return 0 if result["blocks_verified"] == result["blocks_checked"] else 1


def _mooncake_for(args: argparse.Namespace):
    import contextlib

    if args.backend != "mooncake":
        return contextlib.nullcontext(None)
    if args.mooncake_master:
        return contextlib.nullcontext(
            {"master_address": args.mooncake_master, "metadata_server": args.mooncake_metadata}
        )

    @contextlib.contextmanager
    def local():
        from kvtier.storage.mooncake_local import LocalMaster, LocalStoreNode

        with LocalMaster() as master, LocalStoreNode(master, 1 << 30):
            yield {
                "master_address": master.master_address,
                "metadata_server": master.metadata_server,
                "global_segment_size": 0,
            }

    return local()


def _print_demo(r: dict, block_size: int) -> None:
    tokens = r["tokens"]
    total = max(1, r["prefill_tokens"])
    print(
        f"\n{r['requests']} requests, {r['prefill_tokens']:,} prefill tokens, "
        f"{r['ranks']} ranks, {r['wall_s']:.1f} s"
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


WRITE_POLICIES = ("write_through", "write_back")


def _serve(args: argparse.Namespace) -> int:
    """One worker process: configuration from --config YAML, KVTIER_* env, then flags."""
    from kvtier.config import load_config
    from kvtier.worker import Worker

    overrides: dict = {
        "rank": args.rank,
        "world_size": args.world_size,
        "instance_id": args.instance_id,
        "num_host_blocks": args.num_host_blocks,
        "device_cache": args.device_cache,
        "device_cache_mode": args.device_cache_mode,
        "device": args.device,
        "namespace": args.namespace,
        "model_dir": args.model_dir,
        "endpoint": args.endpoint,
        "engine_timeout_s": args.engine_timeout_s,
    }
    if args.key_cache_shape:
        overrides["spec"] = KVCacheSpec.from_legacy_args(args)
    if args.write_policy is not None and args.write_policy not in WRITE_POLICIES:
        from kvtier.errors import ConfigError

        raise ConfigError(
            "write_policy", f"got {args.write_policy!r}; allowed: {', '.join(WRITE_POLICIES)}"
        )
    if args.max_model_len:  # stage a whole request per step, as the old staging buffers did
        overrides["staging_blocks"] = (
            -(-args.max_model_len // overrides["spec"].block_size) if "spec" in overrides else None
        )
    if args.device_id is not None:
        overrides["device"] = f"cuda:{args.device_id}" if args.device == "cuda" else args.device
    if args.storage_backend or args.storage_root:
        storage = {"backend": args.storage_backend or "file"}
        if args.storage_root:
            storage["root"] = args.storage_root
        overrides["storage"] = storage
    config = load_config(args.config, overrides, os.environ)
    logging.basicConfig(
        level=getattr(logging, str(config.log_level).upper(), logging.INFO),
        force=True,
        format=f"%(asctime)s rank{config.rank} %(levelname)s %(name)s: %(message)s",
    )
    return Worker(config).serve()


def _bench(args: argparse.Namespace) -> int:
    return args.bench_report(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvtier",
        description="Move LLM KV-cache blocks between device memory, a host pool and storage.",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    sub = p.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="serve a multi-turn chat workload, verifying every block")
    demo.add_argument("--ranks", type=int, default=2)
    demo.add_argument("--backend", default="file", choices=["file", "mooncake", "memory"])
    demo.add_argument("--mooncake-master", help="host:port (default: start one on loopback)")
    demo.add_argument("--mooncake-metadata", help="metadata server URL of that master")
    demo.add_argument("--users", type=int, default=16)
    demo.add_argument("--turns", type=int, default=6)
    demo.add_argument("--block-size", type=int, default=16)
    demo.add_argument("--device-blocks", type=int, default=160)
    demo.add_argument("--host-blocks", type=int, default=256)
    demo.add_argument(
        "--write-policy", default="write_through", choices=["write_through", "write_back"]
    )
    demo.add_argument("--keep-store", metavar="DIR", help="keep the file store in DIR")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true")
    demo.set_defaults(func=_demo)

    serve = sub.add_parser("serve", help="run one worker (one per tensor-parallel rank)")
    serve.add_argument("--config", help="YAML file with worker settings (see README)")
    serve.add_argument("--rank", type=int)
    serve.add_argument("--world-size", "--mp_num", dest="world_size", type=int)
    serve.add_argument("--instance-id")
    serve.add_argument("--num-host-blocks", "--num_cpu_blocks", dest="num_host_blocks", type=int)
    serve.add_argument("--device-cache", help="name of the shared device cache")
    serve.add_argument("--device-cache-mode", choices=["attach", "create"])
    serve.add_argument("--device", help="cpu, cuda or cuda:N")
    serve.add_argument(
        "--storage-backend",
        "--storage_backend",
        dest="storage_backend",
        help="file, mooncake or memory",
    )
    serve.add_argument("--storage-root", help="file backend directory")
    serve.add_argument("--namespace", help="model id used in storage keys")
    serve.add_argument(
        "--model-dir", "--model_path", dest="model_dir", help="model directory holding version.yaml"
    )
    serve.add_argument("--endpoint", help="ipc://PATH or tcp://127.0.0.1:PORT")
    serve.add_argument("--engine-timeout-s", type=float)
    serve.add_argument("--write_policy", "--write-policy", dest="write_policy")
    serve.add_argument(
        "--max_model_len",
        "--max-model-len",
        dest="max_model_len",
        type=int,
        help="longest request in tokens: sizes the storage staging",
    )
    serve.add_argument("--device_id", "--device-id", dest="device_id", type=int)
    from kvtier.spec import legacy_flag_parser

    legacy = serve.add_argument_group("the old engine's cache flags")
    legacy_flag_parser(legacy, required=False)
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks, each beside the limit it is measured against")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from kvtier_bench import copy as copy_bench
    from kvtier_bench import e2e as e2e_bench
    from kvtier_bench import latency as latency_bench
    from kvtier_bench import storage as storage_bench

    b = bench_sub.add_parser("copy", help="device<->host swap GB/s vs contiguous copy and loop")
    copy_bench.add_arguments(b)
    b.set_defaults(func=_bench, bench_report=copy_bench.report)
    b = bench_sub.add_parser("storage", help="storage save/load GB/s vs raw disk / raw Mooncake")
    storage_bench.add_arguments(b)
    b.set_defaults(func=_bench, bench_report=storage_bench.report)
    b = bench_sub.add_parser("e2e", help="the chat workload: device-only vs +host vs kvtier")
    e2e_bench.add_arguments(b)
    b.set_defaults(func=_bench, bench_report=e2e_bench.report)
    b = bench_sub.add_parser("latency", help="1-block swap round trip vs raw ZeroMQ round trip")
    latency_bench.add_arguments(b)
    b.set_defaults(func=_bench, bench_report=latency_bench.report)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except KvtierError as e:
        print(f"kvtier: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
