"""`kvtier bench copy`: swap_out / swap_in GB/s beside a contiguous copy and the per-block loop.

The "+xxh3" columns time the same copies with the block checksum fused in (swap_out with
checksum=True, swap_in_verified): the price of end-to-end integrity on the save and load paths.

For each block size and block count it times, on the same preallocated, pre-touched memory:
- kvtier's BlockCopier (random device ids -> random host ids, every layer and part);
- the limit: the fastest plain contiguous copy of the same number of bytes — on CPU the best
  of torch ``copy_``, numpy ``copyto``, libc ``memmove`` and a copy with non-temporal stores
  (kvtier's native one, on one range); on CUDA ``copy_`` to or from pinned memory;
- the old design: a Python loop of one ``copy_`` per block per layer per part.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Sequence

import numpy as np
import torch

from kvtier import DeviceCache, HostPool, KVCacheSpec, make_copier
from kvtier.memory.copier import _copy
from kvtier.memory.device import cache_name
from kvtier_bench.common import (
    emit,
    gbps,
    interleaved_timings,
    log2_axes,
    progress,
    save_plot,
    standalone,
)
from kvtier_bench.options import copy_arguments as add_arguments

# Each timed sample lasts at least this long (small cases repeat the call): one call of a
# few milliseconds swung by 25% from run to run.
MIN_SAMPLE_S = 0.05

COLUMNS = [
    ("block_size", "block_size", "d"),
    ("num_blocks", "N", "d"),
    ("direction", "direction", "s"),
    ("gbps", "GB/s", ".2f"),
    ("gbps_range", "min-max", "s"),
    ("limit_gbps", "limit GB/s", ".2f"),
    ("limit_kind", "limit", "s"),
    ("ratio_to_limit", "x limit", ".2f"),
    ("loop_gbps", "loop GB/s", ".2f"),
    ("speedup_vs_loop", "x loop", ".2f"),
    ("checksum_gbps", "+xxh3 GB/s", ".2f"),
    ("checksum_ratio_to_limit", "+xxh3 x limit", ".2f"),
]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def run(args: argparse.Namespace) -> list[dict]:
    if args.num_blocks is None:
        args.num_blocks = "16,256,2048,4096" if args.large else "16,256,1024"
    rows = []
    for block_size in _ints(args.block_sizes):
        for n in _ints(args.num_blocks):
            rows += _run_case(args, block_size, n)
    return rows


def _run_case(args: argparse.Namespace, block_size: int, n: int) -> list[dict]:
    """One (block size, N) case on a device cache and a host pool of exactly N blocks each.

    Sizing both to N (not to the largest N of the sweep) makes kvtier's copy and the limit's
    contiguous copy touch the same pages, and keeps memory to what the case needs: a sweep
    that held every case's memory at once (8.6 GB) swung between 0.65 and 1.0 of the limit
    from one invocation to the next, while each case alone was stable.
    """
    spec = KVCacheSpec(
        num_layers=args.layers,
        num_blocks=n,
        num_kv_heads=args.heads,
        block_size=block_size,
        head_dim=args.head_dim,
        dtype="bfloat16",
    )
    rng = np.random.default_rng([args.seed, block_size, n])
    name = cache_name(f"bench{uuid.uuid4().hex[:8]}", 0)
    nbytes = n * spec.block_bytes
    progress(
        f"block_size {block_size}, N={n}: {spec.block_bytes >> 10} KiB/block, "
        f"{nbytes / 2**30:.2f} GiB per side"
    )
    rows = []
    with (
        DeviceCache.create(spec, name, device=args.device) as cache,
        HostPool(spec, n) as pool,
    ):
        _fill_random(cache)
        copier = make_copier(cache, pool)
        dev_ids = rng.permutation(n)
        host_ids = rng.permutation(n)
        copier.swap_out(dev_ids, host_ids)
        _verify(cache, pool, dev_ids, host_ids)
        copier.swap_out(dev_ids, host_ids, checksum=True)  # swap_in_verified needs them
        case = {
            "device": args.device,
            "block_size": block_size,
            "num_blocks": n,
            "num_layers": args.layers,
            "block_bytes": spec.block_bytes,
            "bytes": nbytes,
            "runs": args.runs,
        }
        for direction in ("swap_out", "swap_in"):
            timings = _time_direction(args, cache, pool, copier, dev_ids, host_ids, direction)
            rows.append({**case, "direction": direction, **_figures(timings, nbytes)})
            progress(
                f"  {direction:8s} {rows[-1]['gbps']:.2f} GB/s (limit {rows[-1]['limit_gbps']:.2f})"
            )
        copier.close()
        if args.storage:
            rows.append(_storage_case(args, spec, cache, dev_ids))
    return rows


def _fill_random(cache: DeviceCache) -> None:
    for row in cache.tensors:
        for t in row:
            t.copy_(
                torch.randint(0, 255, t.shape, dtype=torch.uint8).view(t.dtype)
                if t.dtype == torch.uint8
                else torch.randn(t.shape).to(t.dtype)
            )


def _time_direction(args, cache, pool, copier, dev_ids, host_ids, direction: str) -> dict:
    """kvtier's copy, with checksums, the contiguous copy of the same bytes and a per-block
    loop, interleaved over ``args.runs`` rounds."""
    cuda = args.device == "cuda"
    nbytes = len(dev_ids) * cache.spec.block_bytes
    dev_flat = (
        torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        if cuda
        else cache.segment[4096 : 4096 + nbytes]
    )
    host_flat = pool.flat
    if direction == "swap_out":
        fns = {
            "op": lambda: copier.swap_out(dev_ids, host_ids),
            "hashed": lambda: copier.swap_out(dev_ids, host_ids, checksum=True),
        }
        fns.update(plain_copies(host_flat[:nbytes], dev_flat, cuda))
    else:
        fns = {
            "op": lambda: copier.swap_in(host_ids, dev_ids),
            "hashed": lambda: _check_all(copier.swap_in_verified(host_ids, dev_ids)),
        }
        fns.update(plain_copies(dev_flat, host_flat[:nbytes], cuda))
    fns["loop"] = _loop(cache, pool, dev_ids, host_ids, direction, cuda)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    return interleaved_timings(fns, args.runs, sync, MIN_SAMPLE_S)


def plain_copies(dst: torch.Tensor, src: torch.Tensor, cuda: bool) -> dict:
    """The limit: plain copies of the same bytes, one contiguous range to another. On CPU the
    best of torch ``copy_``, numpy ``copyto``, libc ``memmove`` (via ctypes) and a copy with
    non-temporal stores (``_streaming_copy``) is the limit, so kvtier's copier is measured
    against the fastest plain copy this machine has, not one it happens to beat; on CUDA,
    ``copy_`` to or from pinned memory (one DMA)."""
    copies = {"limit:torch": lambda: dst.copy_(src, non_blocking=cuda)}
    if not cuda:
        import ctypes

        dst_np, src_np = dst.numpy(), src.numpy()
        dst_ptr, src_ptr, n = dst.data_ptr(), src.data_ptr(), src.numel()
        copies["limit:numpy"] = lambda: np.copyto(dst_np, src_np)
        copies["limit:memmove"] = lambda: ctypes.memmove(dst_ptr, src_ptr, n)
        threads = torch.get_num_threads()  # as many as kvtier's copier uses
        copies["limit:memmove 256K"] = _parallel_memmove(dst_ptr, src_ptr, n, 1, CHUNK)
        if threads > 1:
            copies[f"limit:memmove x{threads}"] = _parallel_memmove(dst_ptr, src_ptr, n, threads)
            copies[f"limit:memmove 256K x{threads}"] = _parallel_memmove(
                dst_ptr, src_ptr, n, threads, CHUNK
            )
        for t in sorted({1, threads}):  # non-temporal stores: no read of the destination first
            if n % t == 0 and _copy is not None:
                for kind in ("streaming", "cached"):
                    copies[f"limit:{kind} x{t}"] = _native_copy(dst_ptr, src_ptr, n, t, kind)
    return copies


def _native_copy(dst: int, src: int, n: int, threads: int, kind: str):
    """One contiguous range copied by kvtier's native piece copy (a piece per thread) with
    ``streaming`` (non-temporal) or ``cached`` stores, whatever ``kvtier.memory.stores`` chose:
    on some machines streaming stores make the fastest plain copy, on others the slowest."""
    chunk = n // threads
    one = np.array([chunk], dtype=np.int64)
    ids = np.arange(threads, dtype=np.int64)
    args = (np.array([dst], np.int64), one, ids, np.array([src], np.int64), one, ids, one)

    def copy() -> None:
        before = _copy.set_streaming(kind == "streaming")
        try:
            _copy.copy_indexed(*args, threads)
        finally:
            _copy.set_streaming(before)

    return copy


# One large memmove switches glibc to non-temporal stores past a size threshold, slower on some
# machines than the cached stores of smaller copies: the same bytes in 256 KiB memmoves are a
# plain copy too, and sometimes the fastest.
CHUNK = 256 << 10


def _parallel_memmove(dst: int, src: int, n: int, threads: int, chunk: int | None = None):
    """``threads`` threads each copying one contiguous slice (in ``chunk``-byte memmoves, or
    one), at once: ctypes releases the GIL."""
    import ctypes
    from concurrent.futures import ThreadPoolExecutor

    step = -(-n // threads)
    slices = [(dst + i, src + i, min(step, n - i)) for i in range(0, n, step)]

    def copy_slice(d: int, s: int, size: int) -> None:
        piece = chunk or size
        for offset in range(0, size, piece):
            ctypes.memmove(d + offset, s + offset, min(piece, size - offset))

    if threads == 1:
        return lambda: copy_slice(dst, src, n)
    pool = ThreadPoolExecutor(threads, thread_name_prefix="bench-memmove")

    def copy() -> None:
        for future in [pool.submit(copy_slice, *piece) for piece in slices]:
            future.result()

    return copy


def _figures(timings: dict, nbytes: int) -> dict:
    t = {name: timing.median for name, timing in timings.items()}
    limits = {name.split(":", 1)[1]: v for name, v in t.items() if name.startswith("limit:")}
    best = min(limits, key=limits.__getitem__)  # the fastest plain copy is the limit
    t["limit"] = limits[best]
    return {
        "limit_kind": best,
        "limit_gbps_each": {name: gbps(nbytes, v) for name, v in limits.items()},
        "gbps": gbps(nbytes, t["op"]),
        "gbps_range": timings["op"].gbps_range(nbytes),
        "limit_gbps": gbps(nbytes, t["limit"]),
        "loop_gbps": gbps(nbytes, t["loop"]),
        "ratio_to_limit": t["limit"] / t["op"],
        "speedup_vs_loop": t["loop"] / t["op"],
        "checksum_gbps": gbps(nbytes, t["hashed"]),
        "checksum_ratio_to_limit": t["limit"] / t["hashed"],
    }


def _storage_case(args: argparse.Namespace, spec: KVCacheSpec, cache: DeviceCache, dev_ids):
    """The worker's load path (file store -> staging -> device blocks, verified) beside the
    warm file-store load of the same objects into host blocks (the limit it is measured
    against: what storage alone delivers)."""
    import tempfile

    from kvtier.layout.keys import KeyScheme
    from kvtier.memory.host import HostLayout
    from kvtier.storage.file.store import FileStore
    from kvtier.transport import tasks as t
    from kvtier.worker.datapath import DataPath

    n = len(dev_ids)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    hashes = [bytes([i % 256, i // 256]) * 16 for i in range(n)]
    keys = KeyScheme("bench", spec.fingerprint, 0)
    layout = HostLayout(n, n)
    with (
        tempfile.TemporaryDirectory(prefix="kvtier-bench-copy-") as root,
        FileStore(spec, {"root": root}) as store,
        HostPool(spec, layout.total_blocks) as pool,
    ):
        datapath = DataPath(cache, pool, layout, store)
        ids = dev_ids.tolist()
        saved = datapath.run(t.Save(task_id=1, block_hashes=hashes, device_block_ids=ids), keys)
        if len(saved.blocks) != n:
            raise SystemExit(f"bench copy: saved {len(saved.blocks)} of {n} blocks")
        load = t.Load(task_id=2, block_hashes=hashes, device_block_ids=ids)
        names = keys.keys(hashes)
        blocks = [pool.block(i) for i in range(n)]
        fns = {
            "load": lambda: datapath.run(load, keys),
            "warm": lambda: store.get_into(names, blocks),
        }
        timings = interleaved_timings(fns, args.runs, sync, MIN_SAMPLE_S)
        datapath.close()
    nbytes = n * spec.block_bytes
    load_s, warm_s = timings["load"].median, timings["warm"].median
    progress(f"  storage load -> {args.device}: {gbps(nbytes, load_s):.2f} GB/s")
    return {
        "device": args.device,
        "block_size": spec.block_size,
        "num_blocks": n,
        "num_layers": spec.num_layers,
        "block_bytes": spec.block_bytes,
        "direction": f"file load -> {args.device}",
        "bytes": nbytes,
        "gbps": gbps(nbytes, load_s),
        "gbps_range": timings["load"].gbps_range(nbytes),
        "limit_gbps": gbps(nbytes, warm_s),
        "ratio_to_limit": warm_s / load_s,
        "loop_gbps": float("nan"),
        "speedup_vs_loop": float("nan"),
        "checksum_gbps": float("nan"),
        "checksum_ratio_to_limit": float("nan"),
        "runs": args.runs,
        "limit": "file store warm load into host blocks",
    }


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
    rows = run(args)
    emit(rows, args.json, title, COLUMNS, stores=True)
    if args.plot:
        save_plot(args.plot, lambda plt: plot(plt, rows), title)
    return 0


def plot(plt, rows: list[dict]) -> None:
    """One panel per direction: kvtier (solid), with the checksum (dotted) and the contiguous
    copy limit (dashed) against blocks per call, one colour per block size."""
    sizes = sorted({r["block_size"] for r in rows})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, direction in enumerate(("swap_out", "swap_in")):
        ax = plt.subplot(1, 2, i + 1)
        for colour, size in zip(colours, sizes):
            mine = sorted(
                (r for r in rows if r["direction"] == direction and r["block_size"] == size),
                key=lambda r: r["num_blocks"],
            )
            n = [r["num_blocks"] for r in mine]
            ax.plot(n, [r["gbps"] for r in mine], "o-", color=colour, label=f"{size} tokens/block")
            ax.plot(n, [r["checksum_gbps"] for r in mine], ":", color=colour, label="  + xxh3")
            ax.plot(n, [r["limit_gbps"] for r in mine], "--", color=colour, label="  limit")
        counts = sorted({r["num_blocks"] for r in rows})
        log2_axes(ax, counts, [str(c) for c in counts], "blocks per call", "GB/s", direction)


if __name__ == "__main__":
    raise SystemExit(main())
