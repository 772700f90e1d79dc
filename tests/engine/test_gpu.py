"""The CUDA path on a real GPU: copier, pinned pool, IPC-attached workers, partial loads, sleep.

Every test is marked ``gpu`` and skips without CUDA; ``bench/device_check.sh`` runs them on the
device machine (``pytest -m gpu``). What they check is what the CPU tests check, on device
memory: bytes round-trip equal, through every layout kvtier supports.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from kvtier.engine.client import Client
from kvtier.layout.keys import block_hashes
from kvtier.layout.spec import KVCacheSpec, Part
from kvtier.memory.copier import make_copier
from kvtier.memory.device import DeviceCache, cache_name
from kvtier.memory.host import HostPool
from kvtier.transport import tasks as t

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs CUDA (on a GPU machine: bash bench/device_check.sh)",
    ),
]

LAYOUTS = {
    "bf16": dict(num_layers=3, num_kv_heads=4, head_dim=128, dtype="bfloat16"),
    "fp16": dict(num_layers=2, num_kv_heads=8, head_dim=64, dtype="float16"),
    "fp8": dict(num_layers=2, num_kv_heads=2, head_dim=128, dtype="block_wise_fp8"),
    "mla": dict(num_layers=3, num_kv_heads=1, head_dim=576, dtype="bfloat16", has_value=False),
    "extra": dict(
        num_layers=2,
        num_kv_heads=2,
        head_dim=64,
        dtype="bfloat16",
        num_extra_layers=1,
        num_extra_blocks=90,
    ),
}
BLOCK_SIZES = (16, 32, 64, 128)


def _spec(layout: str, block_size: int, num_blocks: int = 64) -> KVCacheSpec:
    return KVCacheSpec(num_blocks=num_blocks, block_size=block_size, **LAYOUTS[layout])


def _fill(cache: DeviceCache, seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for row in cache.tensors:
        for x in row:
            raw = x.view(torch.uint8)
            raw.copy_(
                torch.randint(0, 256, raw.shape, dtype=torch.uint8, device="cuda", generator=gen)
            )


def _block(cache: DeviceCache, d: int) -> list[torch.Tensor]:
    return [x[d].view(torch.uint8).cpu() for row in cache.tensors for x in row]


def _name() -> str:
    return cache_name(f"g{uuid.uuid4().hex[:10]}", 0)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_cuda_copier_is_byte_exact_over_layouts(layout: str, block_size: int) -> None:
    spec = _spec(layout, block_size)
    rng = np.random.default_rng([block_size, len(layout)])
    with DeviceCache.create(spec, _name(), device="cuda") as cache, HostPool(spec, 48) as pool:
        assert pool.pinned  # the host pool of a CUDA cache is page-locked
        _fill(cache, seed=block_size)
        copier = make_copier(cache, pool)
        n = spec.usable_num_blocks
        dev_ids = rng.choice(n, 40, replace=False)
        host_ids = rng.choice(48, 40, replace=False)
        expected = {int(d): _block(cache, int(d)) for d in dev_ids}
        assert copier.swap_out(dev_ids, host_ids) == 40 * spec.block_bytes
        torch.cuda.synchronize()
        for d, h in zip(dev_ids.tolist(), host_ids.tolist()):  # page-first image on the host
            for piece in spec.pieces:
                assert torch.equal(
                    pool.piece(h, piece.layer, piece.part).view(torch.uint8),
                    cache.tensor(piece.layer, piece.part)[d].view(torch.uint8).cpu(),
                )
        targets = rng.permutation(dev_ids)  # back into other device blocks
        for row in cache.tensors:
            for x in row:
                x[torch.as_tensor(targets, device="cuda")] = 0
        assert copier.swap_in(host_ids, targets) == 40 * spec.block_bytes
        torch.cuda.synchronize()
        for d, target in zip(dev_ids.tolist(), targets.tolist()):
            for want, got in zip(expected[d], _block(cache, target), strict=True):
                assert torch.equal(want, got), f"{layout} bs{block_size}: block {d} -> {target}"
        copier.close()


def test_fused_checksums_on_cuda_catch_a_flipped_host_byte() -> None:
    spec = _spec("fp8", 64)
    with DeviceCache.create(spec, _name(), device="cuda") as cache, HostPool(spec, 8) as pool:
        _fill(cache, seed=3)
        copier = make_copier(cache, pool)
        copier.swap_out([1, 2, 3], [0, 1, 2], checksum=True)
        assert copier.swap_in_verified([0, 1, 2], [10, 11, 12]).all()
        pool.block(1).view(torch.uint8)[100] ^= 0x40
        assert copier.swap_in_verified([0, 1, 2], [10, 11, 12]).tolist() == [True, False, True]
        copier.close()


def _hashes(n: int, block_size: int, seed: int = 0) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 50_000, n * block_size)
    return block_hashes(tokens, block_size)


@pytest.fixture
def gpu_engine(tmp_path):
    """An engine's CUDA cache published by IPC handle, and one worker in another process
    attached to it, saving to and loading from a file store."""
    spec = _spec("bf16", 64, num_blocks=128)
    instance = f"g{uuid.uuid4().hex[:8]}"
    cache = DeviceCache.create(spec, cache_name(instance, 0), device="cuda")
    _fill(cache, seed=7)
    root = tmp_path / "store"
    client = Client.launch(
        spec,
        1,
        {"backend": "file", "root": str(root)},
        instance_id=instance,
        log_dir=tmp_path,
        num_host_blocks=16,
        staging_blocks=8,
        client_options={"worker_timeout_s": 30.0},
    )
    try:
        yield spec, cache, client, root
    finally:
        client.close()
        cache.close()


def test_a_worker_attached_by_ipc_saves_and_loads_device_blocks(gpu_engine) -> None:
    spec, cache, client, _ = gpu_engine
    h = _hashes(6, spec.block_size)
    expected = [_block(cache, d) for d in range(1, 7)]
    assert client.save(h, list(range(1, 7))).blocks == list(range(1, 7))
    targets = list(range(40, 46))
    for row in cache.tensors:
        for x in row:
            x[40:46] = 0
    loaded = client.load(h, targets)
    assert (loaded.status, loaded.blocks) == (t.Status.OK, targets)
    torch.cuda.synchronize()
    for want, target in zip(expected, targets):
        for a, b in zip(want, _block(cache, target), strict=True):
            assert torch.equal(a, b)


def test_a_partial_load_never_leaves_failed_bytes_in_device_blocks(gpu_engine) -> None:
    spec, cache, client, root = gpu_engine
    h = _hashes(3, spec.block_size, seed=1)
    assert client.save(h, [1, 2, 3]).blocks == [1, 2, 3]
    from kvtier.layout.keys import KeyScheme
    from kvtier.storage.file.store import FileStore

    key = KeyScheme("default", spec.fingerprint, 0).key(h[1])
    with FileStore(spec, {"root": root}) as store:
        path = store._path(key)
    data = bytearray(path.read_bytes())
    data[200] ^= 0x01  # a payload bit of the second block
    path.write_bytes(bytes(data))
    for row in cache.tensors:
        for x in row:
            x[50:53].view(torch.uint8).fill_(0xAB)
    loaded = client.load(h, [50, 51, 52])
    assert loaded.blocks == [50]
    torch.cuda.synchronize()
    for d in (51, 52):  # the engine's old bytes (verified in staging, never copied) or zeros
        for piece in _block(cache, d):
            assert bool((piece == 0xAB).all()) or not bool(piece.any())


def test_sleep_lets_the_engine_free_its_cache_and_wakeup_attaches_the_new_one(tmp_path) -> None:
    """Sleep must drop the worker's IPC mapping: only then does the engine's ``free`` return
    the memory to the driver (for training). Wakeup attaches what the engine published since."""
    spec = _spec("bf16", 128, num_blocks=2048)  # ~400 MiB: visible in the driver's free memory
    instance = f"g{uuid.uuid4().hex[:8]}"
    name = cache_name(instance, 0)
    torch.cuda.empty_cache()
    free_before, _ = torch.cuda.mem_get_info()
    cache = DeviceCache.create(spec, name, device="cuda")
    client = Client.launch(
        spec,
        1,
        {"backend": "memory"},
        instance_id=instance,
        log_dir=tmp_path,
        num_host_blocks=8,
        staging_blocks=4,
    )
    try:
        assert client.swap_out([1], [0]).status is t.Status.OK
        assert client.control("sleep").code == 200
        assert client.swap_out([1], [0]).status is t.Status.ERROR  # asleep: refused, answered
        cache.close()
        del cache
        torch.cuda.empty_cache()
        free_asleep, _ = torch.cuda.mem_get_info()
        assert free_before - free_asleep < spec.device_bytes // 4, "the worker kept the memory"
        cache = DeviceCache.create(spec, name, device="cuda")
        _fill(cache, seed=11)
        assert client.control("wakeup").code == 200
        assert client.swap_out([5], [1]).status is t.Status.OK
        assert client.swap_in([1], [6]).status is t.Status.OK
        torch.cuda.synchronize()
        for a, b in zip(_block(cache, 5), _block(cache, 6), strict=True):
            assert torch.equal(a, b)
    finally:
        client.close()
        cache.close()


def test_the_device_cache_tensors_are_where_the_spec_says(tmp_path) -> None:
    spec = _spec("fp8", 32)
    with DeviceCache.create(spec, _name(), device="cuda") as cache:
        for layer in range(spec.total_layers):
            for part in spec.parts:
                x = cache.tensor(layer, part)
                assert x.is_cuda and tuple(x.shape) == tuple(spec.part_shape(part))
        assert Part.KEY_SCALE in spec.parts
