"""`kvtier bench storage`: save / load of N page-first blocks per backend, beside the raw limit.

Ops: ``save`` hashes each payload in the backend; ``save_prehashed`` uses the checksum the copier
recorded while it wrote the block (the worker's save path); ``load`` verifies every payload in
the backend; ``load_deferred`` checks headers and leaves the payload check to the host->device
copy, which hashes while it copies (the worker's load path; see ``kvtier bench copy``);
``load_scattered`` (memory) reads straight into the pieces of blocks laid out as a CPU device
cache lays them, verified as it goes (the direct route: vLLM on CPU).

- file: kvtier's FileStore (header, checksum, temp file + rename, index) against a raw write /
  read of the same bytes in the same number of files over as many directories, with the same
  fsync policy and the same number of I/O threads, each file one native open + write/read +
  close (no header, no checksum, no rename); loads warm (page cache) and cold (after fsync +
  POSIX_FADV_DONTNEED).
- mooncake: kvtier's MooncakeStore (header slot + payload, checksums, verification) against raw
  ``batch_put_from`` / ``batch_get_into`` of objects of the same size from the same registered
  pool, through the same client.
- s3: kvtier's S3Store against obstore's raw put / get of the same objects at the same
  concurrency (``kvtier_bench.storage_s3``; a SeaweedFS server on loopback unless named).
- memory: a tier chain's memory tier (``tiers: [memory, file]``, loads served from memory)
  against the fastest plain contiguous copy of the same bytes (``raw_kind``: torch, numpy,
  memmove or non-temporal stores, on one or more threads; ``kvtier bench copy``'s limit).
GB/s counts payload bytes (the page-first blocks) for both. ``--mac on`` (or ``both``) runs
kvtier's side with authenticated objects (``storage.mac_key_file``: a 128-bit keyed BLAKE3 MAC
over every object, made on save and checked on load): ``both`` shows what authentication costs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvtier import HostPool, KVCacheSpec
from kvtier.storage import Read, Verify, make_backend
from kvtier.transport import auth
from kvtier_bench.common import Timing, emit, log2_axes, progress, save_plot, standalone
from kvtier_bench.copy import plain_copies
from kvtier_bench.options import storage_arguments as add_arguments
from kvtier_bench.storage_raw import (
    RawFiles,
    RawMooncake,
    best_limit,
    device_like_pieces,
    drop_page_cache,
    mooncake_store,
)
from kvtier_bench.storage_s3 import bench_s3
from kvtier_bench.storage_trials import Trial, _interleaved, _keys, _rows, _save_trials

COLUMNS = [
    ("backend", "backend", "s"),
    ("op", "op", "s"),
    ("mac", "MAC", "s"),
    ("object_mib", "object MiB", ".0f"),
    ("num_objects", "N", "d"),
    ("gbps", "GB/s", ".2f"),
    ("gbps_range", "min-max", "s"),
    ("raw_gbps", "raw GB/s", ".2f"),
    ("ratio_to_raw", "x raw", ".2f"),
    ("raw_kind", "raw (memory)", "s"),
]

# 1 MiB: 16 layers x K,V x 8 heads x 16 tokens x 128 x bf16. 8 MiB: 32 layers, 64 tokens.
SIZES = {
    1: dict(num_layers=16, num_kv_heads=8, block_size=16, head_dim=128),
    8: dict(num_layers=32, num_kv_heads=8, block_size=64, head_dim=128),
}


def run(args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-key-") as key_dir:
        mac_key_file = str(Path(key_dir) / "mac.key")
        auth.write_key(mac_key_file)
        modes = {"off": [None], "on": [mac_key_file], "both": [None, mac_key_file]}[args.mac]
        rows: list[dict] = []
        for key_file in modes:
            args.store_options = {"mac_key_file": key_file} if key_file else {}
            for row in _run_sizes(args):
                row["mac"] = "on" if key_file else "off"
                rows.append(row)
    return rows


def _run_sizes(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    for size in map(int, args.sizes):  # checked by the option: 1 and/or 8
        spec = KVCacheSpec(num_blocks=1, dtype="bfloat16", **SIZES[size])
        n = max(1, args.bytes_per_run // spec.block_bytes)
        with HostPool(spec, 2 * n, pin=False) as pool:
            gen = torch.Generator().manual_seed(size)
            pool.slab.copy_(
                torch.randint(0, 256, pool.slab.shape, dtype=torch.uint8, generator=gen)
            )
            for backend in args.backends:  # checked by the option
                progress(f"{backend}: {n} objects of {spec.block_bytes >> 20} MiB")
                if backend == "file":
                    rows += _bench_file(args, spec, pool, n)
                elif backend == "mooncake":
                    rows += _bench_mooncake(args, spec, pool, n, remote=True)
                    rows += _bench_mooncake(args, spec, pool, n, remote=False)
                else:
                    rows += (_bench_memory if backend == "memory" else bench_s3)(
                        args, spec, pool, n
                    )
    return rows


# ---- file ------------------------------------------------------------------------------------


def _bench_file(args, spec, pool, n) -> list[dict]:
    root = Path(args.root or tempfile.mkdtemp(prefix="kvtier-bench-"))
    store_dir, raw_dir = root / "store", root / "raw"
    raw_dir.mkdir(parents=True, exist_ok=True)
    blocks = [pool.block(i) for i in range(n)]
    targets = [pool.block(n + i) for i in range(n)]
    threads = ThreadPoolExecutor(args.io_threads)
    options = {"root": str(store_dir), "fsync": args.fsync, "io_threads": args.io_threads}
    store = make_backend(spec, {"backend": "file", **options, **args.store_options})
    raw = RawFiles(raw_dir, blocks, targets, threads, args.fsync)
    rows = []
    try:
        trials = {
            "raw": Trial(raw.fresh_paths, raw.write, raw.remove),
            **_save_trials(store, spec, blocks),
        }
        rows += _rows("file", spec, n, _interleaved(trials, args.runs), "raw", args.runs)
        rows += _file_loads(args, spec, store, raw)
        assert torch.equal(pool.slab[:n], pool.slab[n:]), "bench storage: loaded bytes differ"
    finally:
        threads.shutdown()
        raw.close()
        store.close()
        if args.root is None:
            shutil.rmtree(root, ignore_errors=True)
        else:
            shutil.rmtree(store_dir, ignore_errors=True)
            shutil.rmtree(raw_dir, ignore_errors=True)
    for row in rows:
        row["fsync"] = args.fsync
    return rows


def _file_loads(args, spec, store, raw: RawFiles) -> list[dict]:
    """Warm and cold loads of stored objects beside raw reads of the same bytes."""
    n = raw.n
    keys, paths = _keys(spec, n), raw.fresh_paths()
    store.put_from(keys, raw.blocks)
    raw.write(paths)
    os.sync()
    rows = []
    for temp in ("warm", "cold"):
        cold = temp == "cold"

        def load(out, cold=cold):
            if cold:
                drop_page_cache(store, keys)
            assert all(store.read(Read(keys, raw.targets, out)).found), (
                "bench storage: a load missed"
            )

        trials = {
            "raw": Trial(lambda: None, lambda _, cold=cold: raw.read(paths, cold)),
            f"load_{temp}": Trial(lambda: None, lambda _, f=load: f(Verify.HERE)),
            f"load_{temp}_deferred": Trial(
                lambda: None, lambda _, f=load: f(Verify.CHECKSUM_BY_CALLER)
            ),
        }
        rows += _rows("file", spec, n, _interleaved(trials, args.runs), "raw", args.runs)
    return rows


# ---- memory -----------------------------------------------------------------------------------


def _memory_rows(spec, n, timings: dict[str, Timing], runs: int) -> list[dict]:
    """Rows against the fastest of the plain copies (``limit:*`` trials)."""
    best, limit, ops = best_limit(timings)
    rows = _rows("memory", spec, n, {**ops, "raw": limit}, "raw", runs)
    return [{**row, "raw_kind": best} for row in rows]


def _bench_memory(args, spec, pool, n) -> list[dict]:
    """The memory tier in front of a file store, against the fastest plain copy (above)."""
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-"))
    memory = {"backend": "memory", "capacity_bytes": 2 * n * (spec.block_bytes + 64)}
    tiers = [memory, {"backend": "file", "root": str(root)}]
    store = make_backend(spec, {"tiers": tiers, "write": "back", **args.store_options})
    plain_src = pool.slab[:n].reshape(-1).clone()
    plain_dst = torch.zeros_like(plain_src)  # touched: no page faults in the limit
    copies = plain_copies(plain_dst, plain_src, cuda=False).items()
    limits = {name: Trial(lambda: None, lambda _, f=f: f()) for name, f in copies}
    blocks = [pool.block(i) for i in range(n)]
    targets = [pool.block(n + i) for i in range(n)]
    try:
        trials = {**limits, **_save_trials(store, spec, blocks)}
        rows = _memory_rows(spec, n, _interleaved(trials, args.runs), args.runs)
        keys = _keys(spec, n)
        assert all(store.put_from(keys, blocks))

        def load(out):
            assert all(store.read(Read(keys, targets, out)).found), "bench storage: a load missed"

        device_like = torch.zeros(n * spec.block_bytes, dtype=torch.uint8)  # touched
        pieces = device_like_pieces(device_like, spec, n)

        def load_scattered():
            ok = store.scattered().get_into_scattered(keys, pieces)
            assert all(ok), "bench storage: a scattered load missed or failed its checksum"

        trials = {
            **limits,
            "load": Trial(lambda: None, lambda _: load(Verify.HERE)),
            "load_deferred": Trial(lambda: None, lambda _: load(Verify.CHECKSUM_BY_CALLER)),
            "load_scattered": Trial(lambda: None, lambda _: load_scattered()),
        }
        rows += _memory_rows(spec, n, _interleaved(trials, args.runs), args.runs)
        load(Verify.HERE)
        assert torch.equal(pool.slab[:n], pool.slab[n : 2 * n]), (
            "bench storage: loaded bytes differ"
        )
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    return rows


# ---- mooncake --------------------------------------------------------------------------------


def _bench_mooncake(args, spec, pool, n, remote: bool) -> list[dict]:
    """remote: objects live in a separate store-node process, reached over TCP loopback (the
    cluster shape: workers are pure clients). local: in this process's own segment (a memcpy:
    the worst case for the relative cost of checksums)."""
    name = "mooncake" if remote else "mooncake-local"
    store, started = mooncake_store(args, spec, n, remote)
    store.register_host_pool(pool)
    try:
        raw = RawMooncake(store._store, spec, pool, n)  # the same client, for the raw calls
        trials = {
            "raw": Trial(lambda: _keys(spec, n), raw.put, raw.remove),
            **_save_trials(store, spec, raw.blocks),
        }
        rows = _rows(name, spec, n, _interleaved(trials, args.runs), "raw", args.runs)
        keys, raw_keys = _keys(spec, n), _keys(spec, n)
        assert all(store.put_from(keys, raw.blocks))
        raw.put(raw_keys)

        def load(out):
            assert all(store.read(Read(keys, raw.targets, out)).found), (
                "bench storage: a load missed"
            )

        trials = {
            "raw": Trial(lambda: None, lambda _: raw.get(raw_keys)),
            "load": Trial(lambda: None, lambda _: load(Verify.HERE)),
            "load_deferred": Trial(lambda: None, lambda _: load(Verify.CHECKSUM_BY_CALLER)),
        }
        rows += _rows(name, spec, n, _interleaved(trials, args.runs), "raw", args.runs)
        load(Verify.HERE)
        assert torch.equal(pool.slab[:n], pool.slab[n:]), "bench storage: loaded bytes differ"
        raw.remove(keys + raw_keys)
    finally:
        store.close()
        for process in started:
            process.stop()
    return rows


def report(args: argparse.Namespace) -> int:
    title = (
        f"kvtier bench storage (median of {args.runs} runs; file fsync={args.fsync}, "
        f"{args.io_threads} I/O threads; GB/s of payload)"
    )
    rows = run(args)
    emit(rows, args.json, title, COLUMNS, stores=True)
    if args.plot:
        save_plot(args.plot, lambda plt: plot(plt, rows), title)
    return 0


def plot(plt, rows: list[dict]) -> None:
    """A panel per backend (columns) and MAC setting (rows): each operation's GB/s (solid, one
    colour per operation in every panel) and the raw limits it is measured against (dashed,
    each distinct one drawn once) against the object size."""
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    macs = list(dict.fromkeys(r.get("mac", "off") for r in rows))
    ops = list(dict.fromkeys(r["op"] for r in rows))
    colours = dict(zip(ops, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 2))
    sizes = sorted({r["object_mib"] for r in rows})
    plt.gcf().set_size_inches(10, 1 + 4.5 * len(macs))
    for row, mac in enumerate(macs):
        for column, backend in enumerate(backends):
            ax = plt.subplot(len(macs), len(backends), row * len(backends) + column + 1)
            limits_drawn: set[tuple[float, ...]] = set()
            for op in ops:
                mine = sorted(
                    (
                        r
                        for r in rows
                        if (r["backend"], r["op"], r.get("mac", "off")) == (backend, op, mac)
                    ),
                    key=lambda r: r["object_mib"],
                )
                if not mine:
                    continue
                x = [r["object_mib"] for r in mine]
                ax.plot(x, [r["gbps"] for r in mine], "o-", color=colours[op], label=op)
                raw = tuple(r["raw_gbps"] for r in mine)
                if raw not in limits_drawn:
                    limits_drawn.add(raw)
                    ax.plot(x, raw, "--", color=colours[op], alpha=0.6, label=f"limit of {op}")
            title = backend + (f", MAC {mac}" if len(macs) > 1 else "")
            labels = [f"{s:g}" for s in sizes]
            log2_axes(ax, sizes, labels, "object size (MiB)", "GB/s", title)


def main(argv: Sequence[str] | None = None) -> int:
    return standalone("storage", __doc__, add_arguments, report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
