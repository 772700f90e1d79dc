"""`kvtier bench copy`: swap_out / swap_in GB/s beside a contiguous copy and the per-block loop.

The "+xxh3" columns time the same copies with the block checksum fused in (swap_out with
checksum=True, swap_in_verified): the price of end-to-end integrity on the save and load paths.

For each block size and block count it times, on the same preallocated, pre-touched memory:
- kvtier's BlockCopier (random device ids -> random host ids, every layer and part);
- the limit: one contiguous copy of the same number of bytes (to/from pinned memory on CUDA);
- the old design: a Python loop of one ``copy_`` per block per layer per part.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Sequence

import numpy as np
import torch

from kvtier import DeviceCache, HostPool, KVCacheSpec, make_copier
from kvtier.device import cache_name
from kvtier_bench.common import emit, gbps, interleaved_medians, progress, standalone

COLUMNS = [
    ("block_size", "block_size", "d"),
    ("num_blocks", "N", "d"),
    ("direction", "direction", "s"),
    ("gbps", "GB/s", ".2f"),
    ("limit_gbps", "limit GB/s", ".2f"),
    ("ratio_to_limit", "x limit", ".2f"),
    ("loop_gbps", "loop GB/s", ".2f"),
    ("speedup_vs_loop", "x loop", ".2f"),
    ("checksum_gbps", "+xxh3 GB/s", ".2f"),
    ("checksum_ratio_to_limit", "+xxh3 x limit", ".2f"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--block-sizes", default="16,64", help="tokens per block, comma-separated")
    p.add_argument("--num-blocks", default="16,256,2048", help="blocks per call, comma-separated")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--runs", type=int, default=5, help="timed runs per figure (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object per row")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    for block_size in _ints(args.block_sizes):
        rows += _run_block_size(args, block_size)
    return rows


def _run_block_size(args: argparse.Namespace, block_size: int) -> list[dict]:
    counts = _ints(args.num_blocks)
    capacity = max(counts)
    spec = KVCacheSpec(
        num_layers=args.layers,
        num_blocks=capacity,
        num_kv_heads=args.heads,
        block_size=block_size,
        head_dim=args.head_dim,
        dtype="bfloat16",
    )
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rng = np.random.default_rng(args.seed)
    name = cache_name(f"bench{uuid.uuid4().hex[:8]}", 0)
    progress(
        f"block_size {block_size}: {args.layers} layers, {spec.block_bytes >> 10} KiB/block, "
        f"{capacity} blocks ({spec.device_bytes / 2**30:.1f} GiB per side)"
    )
    rows = []
    with (
        DeviceCache.create(spec, name, device=args.device) as cache,
        HostPool(spec, capacity) as pool,
    ):
        for row in cache.tensors:
            for t in row:
                t.copy_(
                    torch.randint(0, 255, t.shape, dtype=torch.uint8).view(t.dtype)
                    if t.dtype == torch.uint8
                    else torch.randn(t.shape).to(t.dtype)
                )
        copier = make_copier(cache, pool)
        dev_flat = (
            torch.empty(capacity * spec.block_bytes, dtype=torch.uint8, device="cuda")
            if cuda
            else cache.segment[4096 : 4096 + capacity * spec.block_bytes]
        )
        dev_flat.fill_(1)
        host_flat = pool.flat
        for n in counts:
            dev_ids = rng.permutation(spec.num_blocks)[:n]
            host_ids = rng.permutation(pool.num_blocks)[:n]
            nbytes = n * spec.block_bytes
            copier.swap_out(dev_ids, host_ids)
            _verify(cache, pool, dev_ids, host_ids)
            copier.swap_out(dev_ids, host_ids, checksum=True)  # swap_in_verified needs them
            for direction in ("swap_out", "swap_in"):
                if direction == "swap_out":
                    fns = {
                        "op": lambda d=dev_ids, h=host_ids: copier.swap_out(d, h),
                        "hashed": lambda d=dev_ids, h=host_ids: copier.swap_out(
                            d, h, checksum=True
                        ),
                        "limit": lambda b=nbytes: host_flat[:b].copy_(
                            dev_flat[:b], non_blocking=cuda
                        ),
                    }
                else:
                    fns = {
                        "op": lambda d=dev_ids, h=host_ids: copier.swap_in(h, d),
                        "hashed": lambda d=dev_ids, h=host_ids: _check_all(
                            copier.swap_in_verified(h, d)
                        ),
                        "limit": lambda b=nbytes: dev_flat[:b].copy_(
                            host_flat[:b], non_blocking=cuda
                        ),
                    }
                fns["loop"] = _loop(cache, pool, dev_ids, host_ids, direction, cuda)
                t = interleaved_medians(fns, args.runs, sync)
                rows.append(
                    {
                        "device": args.device,
                        "block_size": block_size,
                        "num_blocks": n,
                        "num_layers": args.layers,
                        "block_bytes": spec.block_bytes,
                        "direction": direction,
                        "bytes": nbytes,
                        "gbps": gbps(nbytes, t["op"]),
                        "limit_gbps": gbps(nbytes, t["limit"]),
                        "loop_gbps": gbps(nbytes, t["loop"]),
                        "ratio_to_limit": t["limit"] / t["op"],
                        "speedup_vs_loop": t["loop"] / t["op"],
                        "checksum_gbps": gbps(nbytes, t["hashed"]),
                        "checksum_ratio_to_limit": t["limit"] / t["hashed"],
                        "runs": args.runs,
                    }
                )
                progress(
                    f"  N={n:5d} {direction:8s} {rows[-1]['gbps']:.2f} GB/s "
                    f"(limit {rows[-1]['limit_gbps']:.2f})"
                )
        copier.close()
    return rows


def _check_all(matches) -> None:
    if not matches.all():
        raise SystemExit("bench copy: swap_in_verified found a checksum mismatch")


def _verify(cache: DeviceCache, pool: HostPool, dev_ids, host_ids) -> None:
    spec = cache.spec
    for d, h in list(zip(dev_ids.tolist(), host_ids.tolist()))[:8]:
        for layer in range(spec.total_layers):
            for part in spec.parts:
                if not torch.equal(
                    pool.piece(h, layer, part).cpu(), cache.tensor(layer, part)[d].cpu()
                ):
                    raise SystemExit(f"bench copy: wrong bytes in block {d} layer {layer} {part}")


def _loop(cache: DeviceCache, pool: HostPool, dev_ids, host_ids, direction: str, cuda: bool):
    """The old design: one indexed ``copy_`` per block per layer per part."""
    spec = cache.spec
    pairs = list(zip(dev_ids.tolist(), host_ids.tolist()))
    # Per (layer, part): the device tensor and the host pool's strided view over all blocks,
    # indexed per call as the old per-layer host cache was.
    views = []
    for piece in spec.pieces:
        raw = pool.slab[:, piece.offset_bytes : piece.offset_bytes + piece.size_bytes]
        host = raw.view(spec.torch_dtype(piece.part)).view(
            spec.part_shape(piece.part, pool.num_blocks)
        )
        views.append((cache.tensor(piece.layer, piece.part), host))

    def loop():
        for d, h in pairs:
            for dev, host in views:
                if direction == "swap_out":
                    host[h].copy_(dev[d], non_blocking=cuda)
                else:
                    dev[d].copy_(host[h], non_blocking=cuda)

    return loop


def main(argv: Sequence[str] | None = None) -> int:
    return standalone("copy", __doc__, add_arguments, report, argv)


def report(args: argparse.Namespace) -> int:
    title = (
        f"kvtier bench copy ({args.device}, bfloat16, {args.heads} heads, head_dim "
        f"{args.head_dim}, {args.layers} layers, K+V; median of {args.runs} runs)"
    )
    emit(run(args), args.json, title, COLUMNS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
