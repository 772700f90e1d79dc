"""The `kvtier` command: demo, bench, inspect."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.copier import make_copier
from kvtier.device import DeviceCache, cache_name
from kvtier.errors import KvtierError
from kvtier.host import HostPool
from kvtier.spec import KVCacheSpec


def _demo(args: argparse.Namespace) -> int:
    """A swap round trip through a shared-memory device cache and a host pool, verified."""
    spec = KVCacheSpec(
        num_layers=args.layers,
        num_blocks=args.device_blocks,
        num_kv_heads=8,
        block_size=args.block_size,
        head_dim=128,
        dtype=args.dtype,
    )
    rng = np.random.default_rng(args.seed)
    name = cache_name(f"demo{uuid.uuid4().hex[:8]}", 0)
    n = min(args.blocks, spec.num_blocks, args.host_blocks)
    with DeviceCache.create(spec, name) as cache, HostPool(spec, args.host_blocks) as pool:
        gen = torch.Generator().manual_seed(args.seed)
        for row in cache.tensors:
            for t in row:
                t.view(torch.uint8).copy_(
                    torch.randint(
                        0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen
                    )
                )
        copier = make_copier(cache, pool)
        dev_ids = rng.permutation(spec.num_blocks)[:n]
        host_ids = rng.permutation(pool.num_blocks)[:n]
        expected = [[t[torch.from_numpy(dev_ids)].clone() for t in row] for row in cache.tensors]
        t0 = time.perf_counter()
        moved_out = copier.swap_out(dev_ids, host_ids)
        t_out = time.perf_counter() - t0
        for row in cache.tensors:  # the engine reuses the device blocks for something else
            for t in row:
                t.view(torch.uint8)[torch.from_numpy(dev_ids)] = 0xA5
        t0 = time.perf_counter()
        moved_in = copier.swap_in(host_ids, dev_ids)
        t_in = time.perf_counter() - t0
        verified = sum(
            int(
                torch.equal(t[int(d)].view(torch.uint8), expected[layer][part][i].view(torch.uint8))
            )
            for layer, row in enumerate(cache.tensors)
            for part, t in enumerate(row)
            for i, d in enumerate(dev_ids.tolist())
        )
        pieces = n * spec.total_layers * len(spec.parts)
        copier.close()
    result = {
        "spec": spec.to_dict(),
        "fingerprint": spec.fingerprint,
        "blocks": n,
        "block_bytes": spec.block_bytes,
        "swap_out_bytes": moved_out,
        "swap_in_bytes": moved_in,
        "swap_out_gbps": moved_out / t_out / 1e9,
        "swap_in_gbps": moved_in / t_in / 1e9,
        "pieces_verified": verified,
        "pieces_total": pieces,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"kvtier demo: swap round trip through shared-memory device cache {name}")
        print(
            f"  layout   {spec.num_layers} layers x K,V x {spec.num_kv_heads} heads x "
            f"{spec.block_size} tokens x {spec.head_dim} {spec.dtype.value} "
            f"= {spec.block_bytes >> 10} KiB per block (fingerprint {spec.fingerprint})"
        )
        print(
            f"  swap_out {n} random device blocks -> host: {moved_out / 2**20:.1f} MiB "
            f"in {t_out * 1e3:.2f} ms ({result['swap_out_gbps']:.2f} GB/s)"
        )
        print("  scribbled over the device blocks")
        print(
            f"  swap_in  host -> the same device blocks: {moved_in / 2**20:.1f} MiB "
            f"in {t_in * 1e3:.2f} ms ({result['swap_in_gbps']:.2f} GB/s)"
        )
        print(f"  integrity: {verified} of {pieces} (block, layer, part) pieces verified")
    return 0 if verified == pieces else 1


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

    demo = sub.add_parser("demo", help="run a verified swap round trip and print what it did")
    demo.add_argument("--layers", type=int, default=8)
    demo.add_argument("--block-size", type=int, default=16)
    demo.add_argument("--dtype", default="bfloat16")
    demo.add_argument("--device-blocks", type=int, default=512)
    demo.add_argument("--host-blocks", type=int, default=256)
    demo.add_argument("--blocks", type=int, default=128, help="blocks to swap out and back")
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
    from kvtier_bench import latency as latency_bench
    from kvtier_bench import storage as storage_bench

    b = bench_sub.add_parser("copy", help="device<->host swap GB/s vs contiguous copy and loop")
    copy_bench.add_arguments(b)
    b.set_defaults(func=_bench, bench_report=copy_bench.report)
    b = bench_sub.add_parser("storage", help="storage save/load GB/s vs raw disk / raw Mooncake")
    storage_bench.add_arguments(b)
    b.set_defaults(func=_bench, bench_report=storage_bench.report)
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
