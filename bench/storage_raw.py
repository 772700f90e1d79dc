"""The limits `kvtier bench storage` measures against: the same bytes as plain files,
Mooncake's own batch API, the fastest plain copy in memory; and the Mooncake store a run uses
(with what it started)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvtier.storage import make_backend
from kvtier.storage.file import io as file_io
from kvtier_bench.common import gbps, median_seconds

RAW_CHILD_TIMEOUT_S = 600  # a raw get's child: start, put, 15 gets; minutes only when stuck


class RawFiles:
    """The limit a file store is measured against: the same bytes as plain files (a 64-byte
    header and the payload), the same number of files, threads and fsync policy, each file
    written or read by one call of ``file_io.write_object`` / ``read_object`` (native, without
    the GIL, where ``kvtier._fileio`` is built: the syscalls alone) and spread over as many
    directories as the store's fan-out. (Python's open/pwritev/close per file, all in one
    directory, ran 1 MiB writes at 0.5 GB/s with four threads on two cores: the GIL and the
    directory's lock, not the disk — a limit below the store's own rate.)"""

    FANOUT = 256

    def __init__(self, directory: Path, blocks, targets, threads: ThreadPoolExecutor, fsync: str):
        self.directory, self.blocks, self.targets = directory, blocks, targets
        self.threads, self.sync_data = threads, fsync != "none"
        self.n = len(blocks)
        self.dir_fds = []
        for i in range(self.FANOUT):
            (directory / f"{i:02x}").mkdir(parents=True, exist_ok=True)
            self.dir_fds.append(os.open(directory / f"{i:02x}", os.O_RDONLY | os.O_DIRECTORY))

    def close(self) -> None:
        for fd in self.dir_fds:
            os.close(fd)

    def fresh_paths(self) -> list[tuple[int, str]]:
        names = [uuid.uuid4().hex for _ in range(self.n)]
        return [(self.dir_fds[int(h[:2], 16)], f"{h}.raw") for h in names]

    def write(self, paths) -> None:
        header = bytes(64)

        def one(i):
            fd, name = paths[i]
            payload = memoryview(self.blocks[i].numpy())
            assert not file_io.write_object(fd, name, 0o600, -1, [header, payload], self.sync_data)

        list(self.threads.map(one, range(self.n)))

    def read(self, paths, cold: bool) -> None:
        if cold:  # as the store's drop_page_cache: every file first, inside the timing
            for dir_fd, name in paths:
                fd = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)

        def one(i):
            fd, name = paths[i]
            body = [memoryview(self.targets[i].numpy())]
            assert not file_io.read_object(fd, name, bytearray(64), body, None, False).err

        list(self.threads.map(one, range(self.n)))

    @staticmethod
    def remove(paths) -> None:
        for dir_fd, name in paths:
            os.unlink(name, dir_fd=dir_fd)


class RawMooncake:
    """The limit: Mooncake's own batch API on the same registered blocks, through one client."""

    def __init__(self, client, spec, pool, n: int) -> None:
        self.client = client
        self.blocks = [pool.block(i) for i in range(n)]
        self.targets = [pool.block(n + i) for i in range(n)]
        self.ptrs = [b.data_ptr() for b in self.blocks]
        self.target_ptrs = [b.data_ptr() for b in self.targets]
        self.sizes = [spec.block_bytes] * n

    def put(self, keys) -> None:
        codes = self.client.batch_put_from(keys, self.ptrs, self.sizes)
        assert all(c == 0 for c in codes), f"raw put failed: {set(codes)}"

    def get(self, keys) -> None:
        self.client.batch_get_into(keys, self.target_ptrs, self.sizes)

    def remove(self, keys) -> None:
        self.client.batch_remove(keys, True)


def mooncake_store(args, spec, n: int, remote: bool):
    """A MooncakeStore (and the local master / store node started for it, to stop after)."""
    from kvtier.storage.mooncake.local import LocalMaster, LocalStoreNode

    segment = 4 * n * (spec.block_bytes + 64) + (64 << 20)
    started: list = []
    if args.mooncake_master:
        config = {
            "backend": "mooncake",
            "master_address": args.mooncake_master,
            "metadata_server": args.mooncake_metadata,
        }
    else:
        master = LocalMaster().start()
        started.append(master)
        config = master.config()
    try:  # whatever fails to start, stop what did
        if started and remote:
            started.insert(0, LocalStoreNode(started[0], segment).start())
        options = {**config, "global_segment_size": 0 if remote else segment}
        return make_backend(spec, {**options, **args.store_options}), started
    except BaseException:
        for process in started:
            process.stop()
        raise


def raw_mooncake_gbps(
    storage: dict, objects: int, runs: int, beside: Callable[[], Any] | None = None
) -> float:
    """Mooncake's own batch get of ``objects`` objects of one block of ``kvtier bench
    cluster``'s model from the node of ``storage``, through one client, in a child process
    started with kvtier's bind guard (its transfer engine listens on loopback only, as the
    engines' do). ``beside``: a context manager entered once the child is set up (started,
    connected, its objects put) and left when its gets are timed — what they run beside."""
    from kvtier.storage.mooncake.config import process_environment

    storage = {k: v for k, v in storage.items() if k != "mac_key_file"}
    env = {**os.environ, **process_environment(storage), "GLOG_minloglevel": "2"}
    code = "import sys; from kvtier_bench.storage_raw import raw_get; raw_get(sys.argv[1])"
    params = json.dumps({"storage": storage, "objects": objects, "runs": runs})
    with tempfile.TemporaryFile("w+") as errors:
        child = subprocess.Popen(
            [sys.executable, "-c", code, params],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
        )
        watchdog = threading.Timer(RAW_CHILD_TIMEOUT_S, child.kill)  # a child that hangs
        watchdog.start()
        try:
            assert child.stdin is not None and child.stdout is not None
            ready = child.stdout.readline().strip() == "ready"
            if ready:
                with beside() if beside is not None else contextlib.nullcontext():
                    child.stdin.write("go\n")
                    child.stdin.flush()
                    timed = child.stdout.readline()
            child.wait()
        finally:
            watchdog.cancel()
            if child.poll() is None:
                child.kill()
                child.wait()
        if not ready or child.returncode != 0:
            errors.seek(0)
            raise RuntimeError(f"the raw Mooncake get failed:\n{errors.read()[-3000:]}")
    return float(timed.strip())


def raw_get(params_json: str) -> None:
    """(In the child.) Puts the objects, says "ready", waits for "go" on stdin, then prints the
    GB/s of ``batch_get_into``: fp32, 4 layers x K|V x 4 heads x 128 tokens x 64 — one block of
    the bench's model, the size of each kvtier object."""
    import torch

    from kvtier import HostPool, KVCacheSpec

    params = json.loads(params_json)
    objects = params["objects"]
    spec = KVCacheSpec(
        num_layers=4, num_blocks=1, num_kv_heads=4, block_size=128, head_dim=64, dtype="float32"
    )
    with HostPool(spec, 2 * objects, pin=False) as pool:
        pool.slab.copy_(torch.randint(0, 256, pool.slab.shape, dtype=torch.uint8))
        store = make_backend(spec, params["storage"])
        try:
            store.register_host_pool(pool)
            raw = RawMooncake(store._store, spec, pool, objects)
            keys = [f"bench-cluster-raw-{i}" for i in range(objects)]
            raw.put(keys)
            print("ready", flush=True)
            sys.stdin.readline()
            seconds = median_seconds(lambda: raw.get(keys), params["runs"])
            print(gbps(objects * spec.block_bytes, seconds), flush=True)
            raw.remove(keys)
        finally:
            store.close()


def best_limit(timings: dict) -> tuple[str, Any, dict]:
    """Of ``timings``, the fastest plain copy (``limit:*``): its kind and timing, and the rest."""
    limits = {name: t for name, t in timings.items() if name.startswith("limit:")}
    best = min(limits, key=lambda name: limits[name].median)
    others = {name: t for name, t in timings.items() if name not in limits}
    return best.split(":", 1)[1], limits[best], others


def device_like_pieces(region, spec, n: int) -> list[list[memoryview]]:
    """Per block, views of its pieces laid out in ``region`` (a contiguous uint8 tensor of
    ``n`` blocks) as a CPU device cache lays them (one tensor per layer and part, block after
    block): what a direct route's load scatters into."""
    flat = memoryview(region.numpy()).cast("B")
    starts, offset = [], 0
    for piece in spec.pieces:
        starts.append((offset, piece.size_bytes))
        offset += n * piece.size_bytes
    return [[flat[o + b * size : o + (b + 1) * size] for o, size in starts] for b in range(n)]


def drop_page_cache(store, keys) -> None:
    """The store's objects out of the page cache (cold reads; only clean pages go: after
    ``os.sync()``), every file first, as the raw row does."""
    for key in keys:
        fd = os.open(store._path(key), os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
