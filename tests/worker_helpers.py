"""Fixtures for the worker/client tests: engine-owned device caches and a launched client."""

from __future__ import annotations

import contextlib
import uuid

import numpy as np
import torch

from conftest import fill_random
from kvtier.engine.client import Client
from kvtier.layout.keys import block_hashes
from kvtier.layout.spec import KVCacheSpec
from kvtier.memory.device import DeviceCache, cache_name
from kvtier.storage import Read, ReadResult
from kvtier.storage.memory.store import MemoryStore

WSPEC = KVCacheSpec(
    num_layers=2, num_blocks=40, num_kv_heads=2, block_size=16, head_dim=64, dtype="block_wise_fp8"
)
# Heartbeat silence that loses a rank: generous, so that a starved worker on a busy machine is
# not declared dead; process exits are detected at once whatever this is.
FAST = {"worker_timeout_s": 10.0, "task_timeout_s": 60.0, "heartbeat_interval_s": 0.2}


fill = fill_random


class HostBlocksOnlyStore(MemoryStore):
    """The memory store without scattered reads: a CPU data path then takes the staged route
    (as it does for Mooncake), which the plain memory store never exercises; under a memory
    tier, a chain like memory over Mooncake."""

    def scattered(self) -> None:
        return None


class PeerWritableStore(HostBlocksOnlyStore):
    """As Mooncake: reads into host blocks only, and those blocks are memory its peers can
    write (registered). ``peer(key, block)``, when set, is such a peer: called with each block
    this store filled, after its own checks, it may write the block."""

    exposes_registered_memory = True

    def __init__(self, spec, *, mac_key: bytes | None = None) -> None:
        super().__init__(spec, mac_key=mac_key)
        self.peer = None
        self.peer_on_put = None  # the same, on each block a put is about to store

    def put_from(self, keys, host_blocks, checksums=None, originals=None) -> list[bool]:
        """As Mooncake's: the header made over ``originals``, the payload stored from the
        (registered) host block, read after ``peer_on_put`` had its chance to write it."""
        if originals is None:
            return super().put_from(keys, host_blocks, checksums)
        self._check_batch(keys, host_blocks, checksums)
        for i, (key, host_block) in enumerate(zip(keys, host_blocks)):
            if self.exists_prefix([key]):
                continue
            if self.peer_on_put is not None:
                self.peer_on_put(key, host_block)
            known = None if checksums is None else checksums[i]
            header = self.format.header(key, originals[i], known)
            self._store(key, header + host_block.numpy().tobytes(), sound=True)
        return self._count_puts([True] * len(keys))

    def read(self, request: Read) -> ReadResult:
        got = super().read(request)
        for key, host_block, ok in zip(request.keys, request.host_blocks, got.found):
            if ok and self.peer is not None:
                self.peer(key, host_block)
        return got


def hashes(n: int, seed: int = 0) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 50_000, n * WSPEC.block_size)
    return block_hashes(tokens, WSPEC.block_size)


def block(cache: DeviceCache, b: int) -> list[torch.Tensor]:
    return [x[b].view(torch.uint8).clone() for row in cache.tensors for x in row]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@contextlib.contextmanager
def engine(tmp_path, world_size: int = 2, storage: dict | None = None, **settings):
    """An 'engine': per-rank device caches in shared memory, and a client with its workers."""
    instance = f"t{uuid.uuid4().hex[:8]}"
    caches = [DeviceCache.create(WSPEC, cache_name(instance, r)) for r in range(world_size)]
    for r, cache in enumerate(caches):
        fill(cache, seed=r)
    storage = storage or {"backend": "file", "root": str(tmp_path / "store")}
    settings.setdefault("num_host_blocks", 16)
    settings.setdefault("staging_blocks", 4)
    client = None
    try:
        client = Client.launch(
            WSPEC,
            world_size,
            storage,
            instance_id=instance,
            log_dir=tmp_path,
            client_options=FAST,
            **settings,
        )
        yield client, caches
    finally:
        if client is not None:
            client.close()
        for cache in caches:
            cache.close()


def scrape_a_busy_worker(tmp_path) -> str:
    """The Prometheus text of a live worker that swapped, saved, loaded and refused a bad task."""
    import socket
    import urllib.request

    from kvtier.transport import tasks as t

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with engine(tmp_path, world_size=1, metrics_port=port) as (client, _):
        client.swap_out([1, 2], [0, 1])
        client.save(hashes(2), [1, 2])
        client.load(hashes(2), [3, 4])
        client.submit(t.SwapOut(device_block_ids=[999], host_block_ids=[0])).result(10)  # an error
        # the engine's load-or-recompute estimates, as the vLLM connector sends them
        estimates = {"prefill_s_per_token": 0.0001, "tier0_load_s_per_block": 0.002}
        assert client.control("estimates", **estimates).code == 200
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def lone_worker_flags(instance: str) -> list[str]:
    """``kvtier serve`` flags of a worker that owns its cache and stores in memory."""
    flags = ["--instance-id", instance, "--key_cache_shape", "40,2,16,64", "--num_layers", "2"]
    return flags + ["--device-cache-mode", "create", "--storage_backend", "memory"]


def local_worker(prefix: str, **settings):
    """A started Worker in this process on a ``local://`` endpoint: it owns its device cache
    (WSPEC) and stores in memory. ``settings`` are WorkerConfig fields."""
    from kvtier.worker.config import WorkerConfig
    from kvtier.worker.loop import Worker

    defaults = {"device_cache_mode": "create", "storage": {"backend": "memory"}}
    config = WorkerConfig(
        spec=WSPEC,
        instance_id=f"{prefix}{uuid.uuid4().hex[:8]}",
        endpoint=f"local://{uuid.uuid4().hex}",
        **{**defaults, **settings},
    )
    return Worker(config).start()
