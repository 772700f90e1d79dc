"""DeviceCache: create / attach across processes, wrap, detach / reattach, stale names."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import uuid

import numpy as np
import pytest
import torch

import procs
from conftest import SPECS, block_bytes_of, fill_random
from kvtier.errors import DeviceCacheDetached, DeviceCacheError, LayoutMismatch
from kvtier.layout.spec import KVCacheSpec, Part
from kvtier.memory.device import CacheMode, DeviceCache, cache_name
from kvtier.memory.shm import SHM_DIR, reclaim_orphans

SPAWN = mp.get_context("spawn")


def run_child(fn, *args):
    with SPAWN.Pool(1) as pool:
        return pool.apply(fn, args)


def test_create_then_attach_sees_the_same_bytes(spec: KVCacheSpec, name: str) -> None:
    with DeviceCache.create(spec, name) as owner:
        assert owner.mode is CacheMode.OWNER
        assert all(int(t.view(torch.uint8).max()) == 0 for row in owner.tensors for t in row)
        fill_random(owner)
        with DeviceCache.attach(spec, name) as peer:
            assert peer.mode is CacheMode.ATTACHED
            for a, b in zip(block_bytes_of(owner, 5), block_bytes_of(peer, 5)):
                assert torch.equal(a, b)
            peer.tensors[0][0][1].view(torch.uint8).fill_(7)
            assert int(owner.tensors[0][0][1].view(torch.uint8).min()) == 7
        for layer in range(spec.total_layers):
            for part in spec.parts:
                t = owner.tensor(layer, part)
                assert tuple(t.shape) == spec.part_shape(part, spec.layer_num_blocks(layer))
                assert t.dtype == spec.torch_dtype(part)
                assert t.data_ptr() % 4096 == 0


def test_another_process_attaches_and_writes(name: str) -> None:
    spec = SPECS["fp8"]
    with DeviceCache.create(spec, name) as owner:
        run_child(procs.attach_and_write, spec.to_dict(), name, 3, 0x5C)
        for row in owner.tensors:
            for t in row:
                assert torch.all(t[3].view(torch.uint8) == 0x5C)
                assert torch.all(t[2].view(torch.uint8) == 0)


def test_attach_with_another_layout_is_refused(name: str) -> None:
    spec = SPECS["bf16"]
    other = KVCacheSpec(**{**spec.to_dict(), "num_kv_heads": 4, "dtype": "float16"})
    with DeviceCache.create(spec, name), pytest.raises(LayoutMismatch) as e:
        DeviceCache.attach(other, name)
    assert "num_kv_heads: 2 != 4" in str(e.value)
    assert "dtype: 'bfloat16' != 'float16'" in str(e.value)


def test_second_owner_of_a_live_name_is_refused(name: str) -> None:
    spec = SPECS["mla"]
    with DeviceCache.create(spec, name), pytest.raises(DeviceCacheError, match="running process"):
        DeviceCache.create(spec, name)


def test_name_left_by_crashed_owner_is_reclaimed(name: str, caplog) -> None:
    spec = SPECS["bf16"]
    proc = SPAWN.Process(target=procs.create_and_die, args=(spec.to_dict(), name))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -9
    assert (SHM_DIR / f"{name}.kvcache").exists()
    with pytest.raises(DeviceCacheError, match="crashed owner"):
        DeviceCache.attach(spec, name)
    with caplog.at_level(logging.WARNING, logger="kvtier.memory.shm"):
        cache = DeviceCache.create(spec, name)
    reclaim = [r for r in caplog.records if "died" in r.getMessage()]
    assert len(reclaim) == 1 and name in reclaim[0].getMessage()
    cache.close()


def test_any_dead_owners_file_is_reclaimed_at_the_next_start(name: str) -> None:
    """Not only a name created again: any kvtier file whose owner is provably dead goes."""
    spec = SPECS["bf16"]
    proc = SPAWN.Process(target=procs.create_and_die, args=(spec.to_dict(), name))
    proc.start()
    proc.join(60)
    assert (SHM_DIR / f"{name}.kvcache").exists()
    other = cache_name(f"t{uuid.uuid4().hex[:10]}", 1)
    with DeviceCache.create(spec, other):  # another name: the sweep at start removes the orphan
        assert not (SHM_DIR / f"{name}.kvcache").exists()


def test_files_of_live_owners_and_other_users_are_never_reclaimed(name: str) -> None:
    spec = SPECS["bf16"]
    foreign = SHM_DIR / f"{name}-x.kvcache"
    foreign.write_bytes(b"another user's file: not locked, never ours to remove")
    try:
        if os.geteuid() == 0:
            os.chown(foreign, 65534, 65534)
        else:
            pytest.skip("needs root to give a file to another user")
        with DeviceCache.create(spec, name):
            # Only this test's names: a dead program's kvtier files elsewhere may go meanwhile.
            assert [n for n in reclaim_orphans() if name in n] == []
            assert (SHM_DIR / f"{name}.kvcache").exists() and foreign.exists()
    finally:
        foreign.unlink(missing_ok=True)


def test_detach_and_reattach_keep_the_bytes(name: str) -> None:
    spec = SPECS["extra"]
    with DeviceCache.create(spec, name) as owner, DeviceCache.attach(spec, name) as peer:
        fill_random(owner, seed=3)
        before = block_bytes_of(peer, 29)
        gen = peer.generation
        peer.detach()
        assert not peer.attached and peer.generation == gen + 1
        with pytest.raises(DeviceCacheDetached):
            peer.tensor(0, Part.KEY)
        peer.reattach()
        assert all(torch.equal(a, b) for a, b in zip(before, block_bytes_of(peer, 29)))
        owner.detach()
        owner.reattach()
        assert all(torch.equal(a, b) for a, b in zip(before, block_bytes_of(owner, 29)))


def test_attach_after_owner_closed_fails(name: str) -> None:
    spec = SPECS["bf16"]
    DeviceCache.create(spec, name).close()
    with pytest.raises(DeviceCacheError, match="no device cache named"):
        DeviceCache.attach(spec, name)


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 300, "../etc"])
def test_bad_names_are_refused(bad: str) -> None:
    with pytest.raises(DeviceCacheError, match="must be 1-200 characters"):
        DeviceCache.create(SPECS["bf16"], bad)


def _tensors(spec: KVCacheSpec, part: Part, dtype=None):
    return [
        torch.zeros(
            spec.part_shape(part, spec.layer_num_blocks(layer)),
            dtype=dtype or spec.torch_dtype(part),
        )
        for layer in range(spec.total_layers)
    ]


def test_wrap_engine_tensors() -> None:
    spec = SPECS["fp8"]
    cache = DeviceCache.wrap(spec, *(_tensors(spec, p) for p in spec.parts))
    assert cache.mode is CacheMode.WRAPPED
    assert cache.tensor(1, Part.VALUE_SCALE).shape == (24, 2, 16)
    with pytest.raises(DeviceCacheError, match="wrap the engine's tensors again"):
        cache.detach()
        cache.reattach()


def test_wrap_dlpack_tensors() -> None:
    spec = SPECS["fp16"]
    keys = [
        np.random.default_rng(i).random(spec.part_shape(Part.KEY)).astype(np.float16)
        for i in range(spec.num_layers)
    ]
    values = [np.zeros(spec.part_shape(Part.VALUE), dtype=np.float16) for _ in keys]
    cache = DeviceCache.wrap(spec, keys, values)
    np.testing.assert_array_equal(cache.tensor(1, Part.KEY).numpy(), keys[1])
    cache.tensor(0, Part.VALUE)[0, 0, 0, 0] = 2.5  # zero-copy: the engine's array changes
    assert values[0][0, 0, 0, 0] == 2.5


def test_wrap_rejects_wrong_tensors() -> None:
    spec = SPECS["bf16"]
    keys, values = _tensors(spec, Part.KEY), _tensors(spec, Part.VALUE)
    with pytest.raises(LayoutMismatch, match=r"layer 1 value: dtype torch.float16"):
        DeviceCache.wrap(spec, keys, values[:1] + _tensors(spec, Part.VALUE, torch.float16)[1:])
    with pytest.raises(LayoutMismatch, match=r"layer 0 key: shape \(40, 2, 16, 32\)"):
        DeviceCache.wrap(
            spec, [torch.zeros(40, 2, 16, 32, dtype=torch.bfloat16)] + keys[1:], values
        )
    with pytest.raises(LayoutMismatch, match="value: need 3 tensors"):
        DeviceCache.wrap(spec, keys, values[:2])
    with pytest.raises(LayoutMismatch, match="value: need 3 tensors .* got none"):
        DeviceCache.wrap(spec, keys)
    with pytest.raises(LayoutMismatch, match="key_scale tensors given"):
        DeviceCache.wrap(spec, keys, values, key_scales=keys)
    transposed = [
        torch.zeros(k.shape[0], k.shape[1], k.shape[3], k.shape[2], dtype=k.dtype).transpose(2, 3)
        for k in keys
    ]
    with pytest.raises(LayoutMismatch, match="each block must be contiguous"):
        DeviceCache.wrap(spec, transposed, values)
    with pytest.raises(LayoutMismatch, match="need a torch tensor or a DLPack tensor"):
        DeviceCache.wrap(spec, ["not a tensor"] * 3, values)


def test_publish_is_for_cuda_only() -> None:
    spec = SPECS["bf16"]
    cache = DeviceCache.wrap(spec, _tensors(spec, Part.KEY), _tensors(spec, Part.VALUE))
    with pytest.raises(DeviceCacheError, match="publish"):
        cache.publish("kvtier-x-rank0-dev0")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_keeps_suballocation_offsets(name: str) -> None:
    spec = SPECS["bf16"]
    # Sub-allocate: each layer's tensors are slices of one big allocation, not at its base.
    big = torch.zeros(
        spec.num_layers * 2 * spec.device_bytes + 1024, dtype=torch.uint8, device="cuda"
    )
    keys, values, offset = [], [], 512
    for layer in range(spec.num_layers):
        for out in (keys, values):
            n = spec.num_blocks * spec.part_block_bytes(Part.KEY)
            t = big[offset : offset + n].view(torch.bfloat16).view(spec.part_shape(Part.KEY))
            t.fill_(len(keys) + len(values) + layer)
            out.append(t)
            offset += n + 512
    cache = DeviceCache.wrap(spec, keys, values)
    cache.publish(name)
    try:
        sums = run_child(procs.attach_cuda_and_checksum, spec.to_dict(), name)
        expected = [float(t.float().sum()) for row in cache.tensors for t in row]
        assert sums == expected
    finally:
        cache.close()


@pytest.mark.parametrize("when", ["before its lock", "after its lock"])
def test_a_cleaner_racing_a_create_costs_a_retry_not_the_create(
    tmp_path, when, monkeypatch
) -> None:
    """Another process's ``reclaim_orphans`` may find a creator's temporary file in the gap
    between its creation and its lock, take the lock and remove it (seen beside the /dev/shm
    churner: a worker failed to start with FileNotFoundError). The creator starts over."""
    from kvtier.memory import shm

    path = tmp_path / "kvtier-race-rank0-dev0.kvcache"
    real_flock, raced = shm.fcntl.flock, []

    def flock_after_a_cleaner(fd, operation):
        if not raced and operation & shm.fcntl.LOCK_EX:
            raced.append(True)
            if when == "before its lock":  # the cleaner takes the temporary file and removes it
                assert shm.reclaim_orphans(tmp_path)
            else:  # the cleaner holds its lock at the moment the creator asks for it
                temp = next(tmp_path.glob(".kvtier-*.creating"))
                cleaner = os.open(temp, os.O_RDONLY)
                real_flock(cleaner, shm.fcntl.LOCK_EX | shm.fcntl.LOCK_NB)
                try:
                    return real_flock(fd, operation)
                finally:
                    os.close(cleaner)
        return real_flock(fd, operation)

    monkeypatch.setattr(shm.fcntl, "flock", flock_after_a_cleaner)
    fd = shm.create_locked(path, "a test file")
    monkeypatch.undo()
    try:
        assert raced and path.exists() and not list(tmp_path.glob(".kvtier-*.creating"))
        assert shm.owner_alive(os.open(path, os.O_RDONLY))  # held by the creator
    finally:
        os.close(fd)


def test_names_planted_where_a_segment_is_created_cost_one_line_not_a_traceback(
    tmp_path, monkeypatch
) -> None:
    """Round 5: a name planted at the temporary name the worker makes its segment under (pid and
    a count, both guessable) made it die with a FileExistsError traceback. Now the name holds
    64 random bits; planted anyway (the randomness pinned here), another name is tried, and when
    every try is taken the error is one line that says what to do."""
    from kvtier.memory import shm

    path = tmp_path / "kvtier-planted.dev"
    monkeypatch.setattr(shm, "_unguessable", lambda: "1-0-guessed")
    (tmp_path / ".kvtier-planted.dev.1-0-guessed.creating").write_bytes(b"planted")
    with pytest.raises(DeviceCacheError, match=r"could not create .*find and stop it"):
        shm.create_locked(path, "a test file")
    assert not path.exists()
    names = iter(["1-0-guessed", "1-1-fresh"])
    monkeypatch.setattr(shm, "_unguessable", lambda: next(names))
    fd = shm.create_locked(path, "a test file")
    os.close(fd)
    assert path.exists()
    assert (tmp_path / ".kvtier-planted.dev.1-0-guessed.creating").read_bytes() == b"planted"
