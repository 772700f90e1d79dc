"""kvtier's store under the engines' own offloading (``kvtier.lmcache``, ``kvtier.sglang``,
``kvtier.vllm.tier``), measured two ways.

1. **LMCache's own benchmark**, ``lmcache bench l2``, run as a user runs it, once with kvtier's
   L2 adapter and once with LMCache's ``fs`` adapter: the same disk (two folders under
   ``--root``), the same objects, keys and requests in flight, in interleaved rounds (the order
   turns each round), every round verified by the bench's own round-trip check. Reported: store
   and load throughput (MB/s) and lookups per second as LMCache prints them, and kvtier ÷ fs.
   Neither adapter syncs to disk; both read back what the page cache holds.
2. **Each surface over kvtier's storage alone**: the same objects stored and loaded through the
   surface — LMCache's adapter tasks (submitted, their event fd waited on), SGLang's zero-copy
   ``batch_set_v1`` / ``batch_get_v1`` from and into a host pool in its layout, vLLM's tier jobs
   (submitted, polled as its scheduler polls) — and straight through the same backend
   (``put_from`` / ``get_into`` of the same bytes, keys built beforehand), and the store's own
   started transfer of the same bytes as byte buffers (``Shelf.start_put`` / ``start_get``, its
   fastest path; the LMCache adapter and vLLM's tier take it). Reported: ms per batch
   of each, interleaved with the order turning each round (a load sample repeats it for 50 ms),
   and surface ÷ alone and ÷ started, each the median of the rounds' ratios: what the surface
   costs over the store (the ratio of the two medians beside it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier_bench.common import Timing, emit, interleaved_timings, progress

ADAPTERS = ("fs", "kvtier")
LOAD_SAMPLE_S = 0.05


def arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=3, help="interleaved lmcache bench l2 runs")
    p.add_argument(
        "--surface-rounds",
        type=int,
        default=41,
        help="interleaved rounds of each surface against the store alone, the order turning "
        "each round (writes to the page cache stall now and then: a median needs many)",
    )
    p.add_argument("--num-keys", type=int, default=32, help="objects per batch (LMCache's)")
    p.add_argument("--data-size-kb", type=int, default=256, help="bytes per object, in KiB")
    p.add_argument("--in-flight", type=int, default=4, help="LMCache's submits in flight")
    p.add_argument(
        "--lmcache-rounds", type=int, default=8, help="measured rounds in each lmcache bench run"
    )
    p.add_argument("--root", help="a folder on the disk to measure (default: a temporary one)")
    p.add_argument("--only", choices=("lmcache", "surfaces"), help="one part only")
    p.add_argument("--json", action="store_true", help="one JSON object per row")


# ---- 1. lmcache bench l2 -------------------------------------------------------------------


def adapter_json(kind: str, folder: Path) -> str:
    if kind == "fs":
        return json.dumps({"type": "fs", "base_path": str(folder)})
    return json.dumps(
        {
            "type": "plugin",
            "module_path": "kvtier.lmcache",
            "class_name": "KvtierL2Adapter",
            "adapter_params": {"storage": {"backend": "file", "root": str(folder)}},
        }
    )


def lmcache_run(kind: str, root: Path, args: argparse.Namespace) -> dict[str, float]:
    """One ``lmcache bench l2`` run of adapter ``kind`` in a fresh folder under ``root``."""
    folder = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=root))
    out = folder.with_suffix(".json")
    cmd = [
        sys.executable, "-m", "lmcache.cli.main", "bench", "l2",
        "--l2-adapter", adapter_json(kind, folder),
        "--num-keys", str(args.num_keys), "--data-size-kb", str(args.data_size_kb),
        "--in-flight", str(args.in_flight), "--rounds", str(args.lmcache_rounds),
        "--lookup-max-hit-rate", "1.0", "--no-skip-verify",
        "--format", "json", "--output", str(out), "--quiet",
    ]  # fmt: skip
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1"}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
        if done.returncode != 0:
            raise SystemExit(f"lmcache bench l2 ({kind}) failed:\n{done.stderr[-3000:]}")
        metrics = json.loads(out.read_text())["metrics"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        out.unlink(missing_ok=True)
    ops = {m["operation"]: m for k, m in metrics.items() if k.startswith("op_")}
    for name, op in ops.items():
        if op["total_success"] != op["total_keys"]:
            raise SystemExit(f"{kind}: {name} {op['total_success']} of {op['total_keys']} keys")
    return {
        "store_mbps": ops["Store"]["throughput_avg_mbps"],
        "load_mbps": ops["Load"]["throughput_avg_mbps"],
        "lookups_per_s": ops["Lookup"]["ops_per_sec_avg"],
    }


def lmcache_rows(root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in ADAPTERS}
    loads = []
    for round_ in range(args.rounds):
        order = ADAPTERS if round_ % 2 == 0 else ADAPTERS[::-1]
        for kind in order:
            progress(f"lmcache bench l2, round {round_ + 1}/{args.rounds}: {kind}")
            runs[kind].append(lmcache_run(kind, root, args))
        loads.append(round(os.getloadavg()[0], 2))
    rows = []
    for measure in ("store_mbps", "load_mbps", "lookups_per_s"):
        fs = [r[measure] for r in runs["fs"]]
        kv = [r[measure] for r in runs["kvtier"]]
        rows.append(
            {
                "part": "lmcache bench l2",
                "measure": measure,
                "fs": statistics.median(fs),
                "kvtier": statistics.median(kv),
                "ratio": statistics.median([k / f for k, f in zip(kv, fs, strict=True)]),
                "ratios": [round(k / f, 3) for k, f in zip(kv, fs, strict=True)],
                "load": loads,
            }
        )
    return rows


# ---- 2. each surface over the store alone --------------------------------------------------


def lmcache_surface(root: Path, n: int, size: int) -> dict[str, Callable[[], object]]:
    from lmcache.cli.commands.bench.l2_adapter_bench.data import (
        create_l1_memory_desc,
        make_aligned_tensor,
        make_memory_objects,
        make_object_keys,
    )
    from lmcache.v1.platform import consume_fd

    from kvtier.hosted.shelf import as_block, fold_hash
    from kvtier.lmcache import KvtierL2Adapter

    l1 = make_aligned_tensor(n * size)  # LMCache's L1 arena, as its benchmark makes it
    settings = {"storage": {"backend": "file", "root": str(root)}}
    adapter = KvtierL2Adapter(settings, l1_memory_desc=create_l1_memory_desc(l1))
    objects = make_memory_objects(l1, n, size, 0)
    blocks = [as_block(o.byte_array) for o in objects]
    offsets = itertools.count(step=n)

    def wait(fd: int, poll: Callable[[], Any]) -> Any:
        while (result := poll()) is None:
            select.select([fd], [], [], 60)
            consume_fd(fd)
        return result

    def store() -> None:
        keys = make_object_keys(n, key_offset=next(offsets))
        task = adapter.submit_store_task(keys, objects)
        wait(adapter.get_store_event_fd(), lambda: adapter.pop_completed_store_tasks().get(task))

    loaded = make_object_keys(n, key_offset=10**9)
    shelf = adapter._shelf(size)

    def alone_keys() -> list[str]:
        base = next(offsets)
        return shelf.keys([fold_hash(i.to_bytes(16, "big")) for i in range(base, base + n)])

    task = adapter.submit_store_task(loaded, objects)
    wait(adapter.get_store_event_fd(), lambda: adapter.pop_completed_store_tasks().get(task))
    loaded_storage = adapter._storage_keys(shelf, loaded)

    def load() -> None:
        task = adapter.submit_load_task(loaded, objects)
        assert wait(adapter.get_load_event_fd(), lambda: adapter.query_load_result(task))

    views = [block.numpy().data for block in blocks]
    return {
        "store": store,
        "store alone": lambda: shelf.put(alone_keys(), blocks),
        "store started": started(shelf.start_put, alone_keys, views),
        "load": load,
        "load alone": lambda: shelf.get(loaded_storage, blocks),
        "load started": started(shelf.start_get, lambda: loaded_storage, views),
        "close": adapter.close,
    }


def sglang_surface(root: Path, n: int, size: int) -> dict[str, Callable[[], object]]:
    import torch  # local: `kvtier bench hosted --help` loads no torch (so do all)
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from kvtier.hosted.shelf import fold_hash
    from kvtier.sglang import KvtierHiCacheStorage
    from kvtier.testing.engines import SGLangHostPool

    # A page of ``size`` bytes: K and V of 8 layers x 16 tokens x 8 heads x dim (bf16).
    head_dim = size // (2 * 8 * 16 * 8 * 2)
    pool = SGLangHostPool(layers=8, heads=8, head_dim=head_dim, page_size=16, pages=2 * n)
    pool.fill(seed=0)
    extra = {"storage": {"backend": "file", "root": str(root)}}
    config = HiCacheStorageConfig(0, 1, 0, 1, 0, 1, False, False, True, "m", extra_config=extra)
    backend = KvtierHiCacheStorage(config)
    backend.register_mem_pool_host(pool)
    counter = itertools.count()
    first, second = pool.indices(list(range(n))), pool.indices(list(range(n, 2 * n)))
    blocks = [torch.frombuffer(bytearray(pool.page_bytes(p)), dtype=torch.uint8) for p in range(n)]

    def fresh() -> list[str]:
        base = next(counter) * n
        return [(i).to_bytes(32, "big").hex() for i in range(base, base + n)]

    loaded = fresh()
    backend.batch_set_v1(loaded, first)
    shelf = backend.shelf
    loaded_storage = backend._keys(loaded)

    def alone_keys() -> list[str]:
        base = next(counter) * n
        return shelf.keys([fold_hash(i.to_bytes(32, "big")) for i in range(base, base + n)], 0)

    views = [block.numpy().data for block in blocks]
    return {
        "store": lambda: backend.batch_set_v1(fresh(), first),
        "store alone": lambda: shelf.put(alone_keys(), blocks),
        "store started": started(shelf.start_put, alone_keys, views),
        "load": lambda: backend.batch_get_v1(loaded, second),
        "load alone": lambda: shelf.get(loaded_storage, blocks),
        "load started": started(shelf.start_get, lambda: loaded_storage, views),
        "close": backend.close,
    }


def vllm_surface(root: Path, n: int, size: int) -> dict[str, Callable[[], object]]:
    import torch  # local: as in sglang_surface
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.tiering.base import TransferJob

    from kvtier.testing.engines import VllmOffloading

    engine = VllmOffloading({"storage": {"backend": "file", "root": str(root)}}, size, n)
    tier, shelf = engine.tier, engine.tier._shelf
    engine.rows.copy_(torch.randint(0, 256, engine.rows.shape, dtype=torch.uint8))
    chunks = list(range(n))
    blocks = [engine.rows[c] for c in chunks]
    counter, jobs = itertools.count(), itertools.count()
    ctx = ReqContext(req_id="bench")

    def fresh() -> list:
        base = next(counter) * n
        return [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(base, base + n)]

    def run(submit: Callable[[TransferJob], None], keys: list) -> None:
        job = TransferJob(next(jobs), keys, chunks, False, ctx)
        submit(job)
        # Until it is done (vLLM's own wait, in its reset), not a polling loop: vLLM polls
        # once a scheduler step, and a tight loop here would take the GIL from the tier.
        tier.drain_jobs()
        if not [r for r in tier.get_finished_jobs() if r.job_id == job.job_id and r.success]:
            raise SystemExit(f"vLLM tier job {job.job_id} failed")

    loaded = fresh()
    run(tier.submit_store, loaded)
    loaded_storage = shelf.keys(loaded)

    views = [block.numpy().data for block in blocks]

    def close() -> None:
        blocks.clear()  # views of vLLM's region: it cannot unmap while they are held
        views.clear()
        engine.close()

    return {
        "store": lambda: run(tier.submit_store, fresh()),
        "store alone": lambda: shelf.put(shelf.keys(fresh()), blocks),
        "store started": started(shelf.start_put, lambda: shelf.keys(fresh()), views),
        "load": lambda: run(tier.submit_load, loaded),
        "load alone": lambda: shelf.get(loaded_storage, blocks),
        "load started": started(shelf.start_get, lambda: loaded_storage, views),
        "close": close,
    }


def started(
    start: Callable[..., None], keys: Callable[[], list[str]], views: list[memoryview]
) -> Callable[[], None]:
    """The store's own started transfer of the same bytes (``Shelf.start_get`` / ``start_put``
    from and into byte buffers), waited on an event: its fastest path, nothing of a surface."""
    answered = threading.Event()
    failed: list[object] = []

    def done(results: list[bool] | None, error: BaseException | None) -> None:
        if error is not None or not results or not all(results):
            failed.append(error or results)
        answered.set()

    def call() -> None:
        answered.clear()
        start(keys(), views, done)
        answered.wait()
        if failed:
            raise SystemExit(f"a started transfer of the store failed: {failed[0]}")

    return call


SURFACES = {"lmcache": lmcache_surface, "sglang": sglang_surface, "vllm tier": vllm_surface}


def surface_rows(root: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    n, size = args.num_keys, args.data_size_kb * 1024
    rows = []
    for name, make in SURFACES.items():
        progress(f"{name}: {args.surface_rounds} interleaved rounds of {n} x {size // 1024} KiB")
        folder = Path(tempfile.mkdtemp(prefix="surface-", dir=root))
        calls = make(folder, n, size)
        try:
            stores = {k: calls[k] for k in ("store", "store alone", "store started")}
            loads = {k: calls[k] for k in ("load", "load alone", "load started")}
            timings = interleaved_timings(stores, args.surface_rounds, alternate=True)
            # A load takes milliseconds: each sample is several (LOAD_SAMPLE_S), so that one
            # call's scheduling does not decide a round.
            timings |= interleaved_timings(
                loads, args.surface_rounds, min_sample_s=LOAD_SAMPLE_S, alternate=True
            )
        finally:
            calls["close"]()
            shutil.rmtree(folder, ignore_errors=True)
        for op in ("store", "load"):
            through, alone, fastest = timings[op], timings[f"{op} alone"], timings[f"{op} started"]
            rows.append(
                {
                    "part": "surface over storage alone",
                    "surface": name,
                    "op": op,
                    "surface_ms": through.median * 1e3,
                    "alone_ms": alone.median * 1e3,
                    "started_ms": fastest.median * 1e3,
                    "ratio": _paired(through, alone),
                    "ratio_started": _paired(through, fastest),
                    "ratio_of_medians": through.median / alone.median,
                    "load": round(os.getloadavg()[0], 2),
                }
            )
    return rows


def _paired(surface: Timing, alone: Timing) -> float:
    """Each round's surface over the same round's store alone, the median of those: the disk's
    pace drifts between rounds (a store's batch took 7 ms in one run, 17 in the next), which a
    ratio of the two medians mixes in."""
    return statistics.median([s / a for s, a in zip(surface.samples, alone.samples, strict=True)])


def report(args: argparse.Namespace) -> int:
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="kvtier-hosted-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        if args.only in (None, "lmcache"):
            emit(
                lmcache_rows(root, args),
                args.json,
                "lmcache bench l2: kvtier's L2 adapter vs LMCache's fs adapter (medians)",
                [("measure", "measure", ""), ("fs", "fs", ".1f"), ("kvtier", "kvtier", ".1f"),
                 ("ratio", "kvtier ÷ fs", ".3f"), ("ratios", "per round", ""),
                 ("load", "load", "")],
            )  # fmt: skip
        if args.only in (None, "surfaces"):
            emit(
                surface_rows(root, args),
                args.json,
                "each surface over kvtier's storage alone (same objects; ms per batch, medians; "
                "alone: get_into / put_from; started: start_get / start_put of byte buffers; "
                "ratios: the median of each round's)",
                [("surface", "surface", ""), ("op", "op", ""), ("surface_ms", "surface", ".2f"),
                 ("alone_ms", "alone", ".2f"), ("started_ms", "started", ".2f"),
                 ("ratio", "surface ÷ alone", ".3f"), ("ratio_started", "÷ started", ".3f"),
                 ("ratio_of_medians", "÷ alone, medians", ".3f"), ("load", "load", "")],
            )  # fmt: skip
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    from kvtier_bench.common import standalone

    sys.exit(standalone("hosted", __doc__, arguments, report))
