"""HostPool: page-first layout, pre-touched slab, shared backing."""

from __future__ import annotations

import uuid

import pytest
import torch

from conftest import SPECS
from kvtier.errors import ConfigError, DeviceCacheError, InvalidBlockIds
from kvtier.layout.spec import KVCacheSpec
from kvtier.memory.host import HEADER_SLOT_BYTES, HostPool
from kvtier.memory.shm import SHM_DIR


def test_page_first_layout(spec: KVCacheSpec) -> None:
    with HostPool(spec, 5) as pool:
        assert pool.slab.shape == (5, spec.block_bytes)
        assert int(pool.slab.max()) == 0  # pre-touched with zeros
        assert not pool.pinned  # no CUDA on this machine
        for piece in spec.pieces:
            view = pool.piece(3, piece.layer, piece.part)
            assert view.dtype == spec.torch_dtype(piece.part)
            assert tuple(view.shape) == spec.part_shape(piece.part, 1)[1:]
            view.view(torch.uint8).fill_(piece.layer * 10 + spec.parts.index(piece.part) + 1)
        # Block 3 is one contiguous run: layer 0 K, layer 0 V, [scales], layer 1 K, ...
        raw = pool.block(3)
        for piece in spec.pieces:
            chunk = raw[piece.offset_bytes : piece.offset_bytes + piece.size_bytes]
            assert torch.all(chunk == piece.layer * 10 + spec.parts.index(piece.part) + 1)
        assert int(pool.slab[2].max()) == 0 and int(pool.slab[4].max()) == 0
        # Each block sits after a header slot: [slot | block] is one stored object.
        assert pool.stride_bytes == HEADER_SLOT_BYTES + spec.block_bytes
        assert pool.block_address(3) == pool.base_address + 3 * pool.stride_bytes + 64
        assert pool.block_address(3) == pool.block(3).data_ptr()
        assert torch.equal(pool.object_view(3)[HEADER_SLOT_BYTES:], pool.block(3))
        assert pool.block_index(pool.block_address(4)) == 4
        assert pool.block_index(pool.block_address(4) + 1) is None
        assert pool.block_index(pool.base_address) is None
        mv = pool.memoryview(3)
        assert len(mv) == spec.block_bytes and mv[0] == 1


def test_bad_arguments() -> None:
    with pytest.raises(ConfigError, match="num_host_blocks"):
        HostPool(SPECS["bf16"], 0)
    with (
        HostPool(SPECS["bf16"], 2) as pool,
        pytest.raises(InvalidBlockIds, match="host block id 2"),
    ):
        pool.block(2)


def test_an_absurd_host_pool_is_refused_before_anything_is_allocated(monkeypatch) -> None:
    """The worker used to create (and then remove) its device cache before the host pool's size
    was checked: every size is checked first now."""
    from kvtier.memory.device import DeviceCache
    from kvtier.worker.config import WorkerConfig
    from kvtier.worker.resources import RankResources

    created: list[str] = []
    original = DeviceCache.create
    monkeypatch.setattr(
        DeviceCache, "create", lambda *a, **k: created.append(a[1]) or original(*a, **k)
    )
    instance = f"absurd{uuid.uuid4().hex[:6]}"
    spec = SPECS["bf16"]
    config = WorkerConfig(
        spec=spec,
        instance_id=instance,
        device_cache_mode="create",
        num_host_blocks=(1 << 50) // spec.block_bytes,  # a petabyte
        storage={"backend": "memory"},
    )
    with pytest.raises(ConfigError, match="num_host_blocks: needs .* GiB of host memory"):
        RankResources(config).open()
    assert created == []
    huge = WorkerConfig(
        spec=KVCacheSpec(**{**spec.to_dict(), "num_blocks": (1 << 50) // spec.block_bytes}),
        instance_id=instance,
        device_cache_mode="create",
        storage={"backend": "memory"},
    )
    with pytest.raises(DeviceCacheError, match="GiB of shared memory"):
        RankResources(huge).open()
    assert created == [] and not list(SHM_DIR.glob(f"kvtier-{instance}-*"))
