"""BlockCopier: real bytes round-trip through every layer and part, bad input is refused."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import procs
from conftest import SPECS, block_bytes_of, fill_random, require_native
from kvtier.errors import DeviceCacheDetached, InvalidBlockIds, LayoutMismatch
from kvtier.layout.checksum import payload_checksum
from kvtier.layout.spec import KVCacheSpec
from kvtier.memory import scatter
from kvtier.memory.copier import CpuBlockCopier, TorchBlockCopier, make_copier
from kvtier.memory.device import DeviceCache, cache_name
from kvtier.memory.host import HostPool

COPIERS = {"native": CpuBlockCopier, "torch": TorchBlockCopier}


@pytest.fixture(params=sorted(COPIERS))
def copier_cls(request):
    return COPIERS[request.param]


def _round_trip(cache: DeviceCache, copier, dev_ids, host_ids) -> None:
    """swap_out, scribble over the device blocks, swap_in, compare every byte."""
    expected = {d: block_bytes_of(cache, d) for d in dev_ids}
    assert copier.swap_out(dev_ids, host_ids) == len(dev_ids) * cache.spec.block_bytes
    for row in cache.tensors:
        for t in row:
            for d in dev_ids:
                t[d].view(torch.uint8).fill_(0xEE)
    assert copier.swap_in(host_ids, dev_ids) == len(dev_ids) * cache.spec.block_bytes
    for d in dev_ids:
        for want, got in zip(expected[d], block_bytes_of(cache, d), strict=True):
            assert torch.equal(want, got), f"device block {d}"


def test_round_trip_every_layout(spec: KVCacheSpec, copier_cls, name: str) -> None:
    with DeviceCache.create(spec, name) as cache, HostPool(spec, 16) as pool:
        fill_random(cache, seed=1)
        copier = copier_cls(cache, pool)
        n = spec.usable_num_blocks
        dev_ids = [0, n - 1, 5, 6, 7, 3]  # first, last, a run, out of order
        host_ids = [15, 0, 3, 4, 5, 9]
        _round_trip(cache, copier, dev_ids, host_ids)
        # The host blocks hold the page-first image of the device blocks.
        for d, h in zip(dev_ids, host_ids):
            for piece in spec.pieces:
                assert torch.equal(
                    pool.piece(h, piece.layer, piece.part).view(torch.uint8),
                    cache.tensor(piece.layer, piece.part)[d].view(torch.uint8),
                )
        copier.close()


def test_swap_in_to_other_blocks_and_extra_layers(copier_cls, name: str) -> None:
    spec = SPECS["extra"]  # extra layer has 45 blocks, main layers 30
    with DeviceCache.create(spec, name) as cache, HostPool(spec, 8) as pool:
        fill_random(cache, seed=2)
        copier = copier_cls(cache, pool)
        src = block_bytes_of(cache, 29)
        copier.swap_out([29], [7])
        copier.swap_in([7], [0])
        assert all(torch.equal(a, b) for a, b in zip(src, block_bytes_of(cache, 0)))
        with pytest.raises(InvalidBlockIds, match="device block id 30 out of range 0..29"):
            copier.swap_out([30], [0])


def _strided(ids: list[int]) -> torch.Tensor:
    """The ids as a view with a step (not contiguous): the native copy must still read them."""
    return torch.tensor(ids).repeat_interleave(2)[::2]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_valid_id_lists_round_trip(data, copier_cls) -> None:
    spec = SPECS["fp8"]
    name = cache_name(f"hyp{np.random.default_rng().integers(1 << 40):x}", 0)
    with DeviceCache.create(spec, name) as cache, HostPool(spec, 12) as pool:
        fill_random(cache, seed=data.draw(st.integers(0, 100)))
        k = data.draw(st.integers(0, min(spec.num_blocks, pool.num_blocks)))
        dev_ids = data.draw(st.permutations(range(spec.num_blocks)))[:k]
        host_ids = data.draw(st.permutations(range(pool.num_blocks)))[:k]
        as_type = data.draw(st.sampled_from([list, np.array, torch.tensor, _strided]))
        copier = copier_cls(cache, pool)
        expected = {d: block_bytes_of(cache, d) for d in dev_ids}
        copier.swap_out(as_type(dev_ids) if k else [], as_type(host_ids) if k else [])
        targets = data.draw(st.permutations(range(spec.num_blocks)))[:k]
        copier.swap_in(host_ids, targets)
        for d, t in zip(dev_ids, targets):
            assert all(torch.equal(a, b) for a, b in zip(expected[d], block_bytes_of(cache, t)))


@pytest.mark.parametrize(
    ("dev", "host", "message"),
    [
        ([1, 2], [1], "device_block_ids has 2 entries but host_block_ids has 1"),
        ([40], [0], "device block id 40 out of range 0..39"),
        ([-1], [0], "device block id -1 out of range"),
        ([0], [8], "host block id 8 out of range 0..7"),
        ([0, 1], [3, 3], "host block id 3 appears twice"),
        ([[0, 1]], [[2, 3]], "must be a flat list of integers"),
        ([0.5], [1], "must be a flat list of integers"),
        (["a"], [1], "must be a flat list of integers"),
    ],
)
def test_bad_swap_out_input(dev, host, message, name: str) -> None:
    spec = SPECS["bf16"]
    with DeviceCache.create(spec, name) as cache, HostPool(spec, 8) as pool:
        fill_random(cache)
        copier = make_copier(cache, pool)
        with pytest.raises(InvalidBlockIds, match=message):
            copier.swap_out(dev, host)
        assert int(pool.slab.max()) == 0  # nothing moved


def test_bad_swap_in_input(name: str) -> None:
    spec = SPECS["bf16"]
    with DeviceCache.create(spec, name) as cache, HostPool(spec, 8) as pool:
        copier = make_copier(cache, pool)
        pool.slab.fill_(9)
        with pytest.raises(InvalidBlockIds, match="device block id 4 appears twice"):
            copier.swap_in([0, 1], [4, 4])
        copier.swap_in([0, 1], [4, 4][:1] + [5])  # duplicates in the *source* are allowed
        copier.swap_in([1, 1], [6, 7])
        assert copier.swap_in([], []) == 0
        assert int(cache.tensor(0, spec.parts[0])[0].view(torch.uint8).max()) == 0
        cache.detach()
        with pytest.raises(DeviceCacheDetached):
            copier.swap_in([0], [0])


def test_copier_refuses_mismatched_pool(name: str) -> None:
    cache, pool = DeviceCache.create(SPECS["bf16"], name), HostPool(SPECS["fp16"], 2)
    with cache, pool, pytest.raises(LayoutMismatch, match="different specs"):
        make_copier(cache, pool)


def test_checksums_recorded_by_swap_out_and_verified_by_swap_in(copier_cls, name: str) -> None:
    spec = SPECS["fp8"]
    with DeviceCache.create(spec, name) as cache, HostPool(spec, 8) as pool:
        fill_random(cache, seed=9)
        copier = copier_cls(cache, pool)
        copier.swap_out([3, 4, 5], [0, 1, 2], checksum=True)
        known = pool.known_checksums([0, 1, 2, 3])
        assert known[3] is None
        assert known[:3] == [payload_checksum(pool.block(i).numpy()) for i in range(3)]
        pool.block(1)[100] ^= 0xFF  # the host copy of block 4 goes bad
        ok = copier.swap_in_verified([0, 1, 2, 3], [10, 11, 12, 13])
        assert ok.tolist() == [True, False, True, False]  # block 3: no known checksum
        assert all(
            torch.equal(a, b) for a, b in zip(block_bytes_of(cache, 3), block_bytes_of(cache, 10))
        )
        copier.swap_out([6], [0])  # rewritten without a checksum: forgotten
        assert pool.known_checksums([0]) == [None]
        assert copier.swap_in_verified([], []).size == 0


def test_large_batch_uses_threads_and_stays_correct(name: str) -> None:
    spec = KVCacheSpec(num_layers=4, num_blocks=64, num_kv_heads=8, block_size=16, head_dim=128)
    with DeviceCache.create(spec, name) as cache, HostPool(spec, 64) as pool:
        fill_random(cache, seed=4)
        copier = make_copier(cache, pool, num_threads=2)
        assert 64 * spec.block_bytes > (4 << 20)  # above the threshold for a second thread
        rng = np.random.default_rng(0)
        _round_trip(cache, copier, list(rng.permutation(64)), list(rng.permutation(64)))


def test_device_pieces_are_each_blocks_pieces_in_page_first_order(spec, name: str) -> None:
    """The views a direct route reads into and writes from: joined in order, one block's
    bytes exactly as a swap-out lays them in a host block; writes land in that block only."""
    with DeviceCache.create(spec, name) as cache, HostPool(spec, 4) as pool:
        fill_random(cache, seed=6)
        copier = make_copier(cache, pool)
        copier.swap_out([2, 7, 5], [0, 1, 2])
        pieces = copier.device_pieces([2, 7, 5], writable=False)
        for i, views in enumerate(pieces):
            assert b"".join(bytes(v) for v in views) == bytes(pool.block(i).numpy())
        before = block_bytes_of(cache, 6)
        for view in copier.device_pieces([7])[0]:
            view[:] = b"\xab" * len(view)
        assert all(bool((t == 0xAB).all()) for t in block_bytes_of(cache, 7))
        assert all(torch.equal(a, b) for a, b in zip(before, block_bytes_of(cache, 6)))
        with pytest.raises(InvalidBlockIds):
            copier.device_pieces([spec.num_blocks])


@pytest.fixture(params=["native", "python"])
def scatter_impl(request, monkeypatch):
    """``copy_scattered`` as built, and its pure-Python fallback (no C compiler)."""
    if request.param == "python":
        monkeypatch.setattr(scatter, "_copy", None)
    else:
        require_native("kvtier._copy")
    return scatter.copy_scattered


@pytest.mark.parametrize("objects", [1, 3, 80])  # 80 x 64 KiB: past the threshold for threads
def test_copy_scattered_round_trips_and_hashes_each_object(scatter_impl, objects) -> None:
    rng = np.random.default_rng(objects)
    sizes = [4096, 100, 28, 61308]  # uneven pieces of one 64 KiB object
    src = [rng.integers(0, 256, sum(sizes), dtype=np.uint8) for _ in range(objects)]
    pieces = [[bytearray(n) for n in sizes] for _ in range(objects)]
    hashes = np.zeros(objects, dtype=np.uint64)
    moved = scatter_impl(src, pieces, to_pieces=True, hashes=hashes)
    assert moved == objects * sum(sizes)
    for whole, row, h in zip(src, pieces, hashes):
        assert b"".join(row) == whole.tobytes()
        assert int(h) == payload_checksum(whole)
    back = [np.zeros(sum(sizes), dtype=np.uint8) for _ in range(objects)]
    again = np.zeros(objects, dtype=np.uint64)
    scatter_impl(back, pieces, to_pieces=False, hashes=again)
    assert all(np.array_equal(a, b) for a, b in zip(src, back)) and (again == hashes).all()
    scatter_impl(back[:1], pieces[:1], to_pieces=False)  # hashes are optional


def test_copy_scattered_refuses_pieces_that_do_not_fit(scatter_impl) -> None:
    whole = [bytearray(64)]
    with pytest.raises(ValueError, match="do not add up"):
        scatter_impl(whole, [[bytearray(32)]], to_pieces=True)
    with pytest.raises(ValueError, match="do not add up"):
        scatter_impl(whole, [[bytearray(32), bytearray(40)]], to_pieces=True)
    with pytest.raises(ValueError, match="one list of pieces"):
        scatter_impl(whole, [], to_pieces=True)
    with pytest.raises((TypeError, BufferError)):  # a destination that cannot be written
        scatter_impl(whole, [[bytes(64)]], to_pieces=True)
    assert whole == [bytearray(64)]


# Every hashing kernel on the same random bytes, in a fresh process (the kernels are chosen
# when kvtier._copy is imported): XXH3-64 of each block, as the xxhash library computes it.
KERNELS_CHECK = """
import json, numpy as np, xxhash
from kvtier import _copy
rng = np.random.default_rng(7)
sizes = [100, 4096, 70000, 5]  # one block of uneven pieces, a piece larger than a hash chunk
src = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
want = xxhash.xxh3_64_intdigest(b"".join(a.tobytes() for a in src))
dst = [np.zeros(n, dtype=np.uint8) for n in sizes]
ptr = lambda arrays: np.array([a.ctypes.data for a in arrays], dtype=np.int64)
h = np.zeros(1, dtype=np.uint64)
_copy.copy_blocks_hashed(ptr(dst), ptr(src), np.array(sizes, np.int64), 4, h, 1)
ok = np.ones(1, dtype=np.uint8)
out = [np.zeros(n, dtype=np.uint8) for n in sizes]
_copy.copy_blocks_verified(ptr(out), ptr(src), np.array(sizes, np.int64), 4, h, ok, 1)
whole = np.concatenate(src)
s = np.zeros(1, dtype=np.uint64)
_copy.copy_scattered([whole], [[bytearray(n) for n in sizes]], True, s, 1)
same = all(np.array_equal(a, b) for a, b in zip(src, out))
# Whole lines into aligned pieces with streaming stores: the fused copy-and-hash.
_copy.set_streaming(True)
lined = whole[: len(whole) // 64 * 64]
f = np.zeros(1, dtype=np.uint64)
_copy.copy_scattered([lined], [[np.zeros(4096, np.uint8), np.zeros(len(lined) - 4096, np.uint8)]],
                     True, f, 1)
fused = int(f[0]) == xxhash.xxh3_64_intdigest(lined.tobytes())
print(json.dumps([_copy.kernels, want, int(h[0]), int(ok[0]), same, int(s[0]), fused]))
"""


@pytest.mark.parametrize("baseline", ["", "1"], ids=["as-chosen", "baseline"])
def test_each_set_of_hashing_kernels_computes_xxh3(baseline) -> None:
    """The hashing kernels are built twice (baseline and AVX2) and picked at import from the
    CPU: whichever runs must give the XXH3-64 the rest of kvtier (and every reader) computes."""
    require_native("kvtier._copy")
    env = {**os.environ, "KVTIER_COPY_BASELINE": baseline}
    out = subprocess.run(
        [sys.executable, "-c", KERNELS_CHECK], env=env, capture_output=True, text=True, check=True
    )
    kernels, want, hashed, verified, same, scattered, fused = json.loads(out.stdout)
    assert kernels == "base" if baseline else kernels in ("base", "avx2")
    assert hashed == want and scattered == want and verified == 1 and same and fused


def test_other_process_attaches_and_swaps(name: str) -> None:
    spec = SPECS["fp8"]
    with DeviceCache.create(spec, name) as cache:
        fill_random(cache, seed=5)
        src = block_bytes_of(cache, 11)
        with mp.get_context("spawn").Pool(1) as p:
            p.apply(procs.attach_and_move_block, (spec.to_dict(), name, 11, 20))
        assert all(torch.equal(a, b) for a, b in zip(src, block_bytes_of(cache, 20)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec_name", sorted(SPECS))
def test_cuda_round_trip(spec_name: str, name: str) -> None:
    spec = SPECS[spec_name]
    with DeviceCache.create(spec, name, device="cuda") as cache, HostPool(spec, 16) as pool:
        assert pool.pinned
        fill_random_cuda(cache)
        copier = make_copier(cache, pool)
        n = spec.usable_num_blocks
        _round_trip(cache, copier, [0, n - 1, 5, 6, 7, 3], [15, 0, 3, 4, 5, 9])
        copier.close()


def fill_random_cuda(cache: DeviceCache) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for row in cache.tensors:
        for t in row:
            raw = t.view(torch.uint8)
            raw.copy_(
                torch.randint(0, 256, raw.shape, dtype=torch.uint8, device="cuda", generator=gen)
            )
