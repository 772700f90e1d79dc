"""kvtier as a secondary tier of vLLM's own offloading, created and driven by vLLM's code: its
``TieringOffloadingSpec`` builds the tier from configuration (``SecondaryTierFactory``, module
path) over a real CPU tier in /dev/shm, and its ``TieringOffloadingManager`` cascades stores to
it and promotes hits from it. Bytes round-trip equal; a stale weight version, a corrupt object
and another parallel geometry are misses; the store's bound holds and evictions are events.

Where this stops: vLLM 0.32's CPU platform refuses its offloading connector's worker side
(``OffloadingConnector`` needs a CUDA device to copy GPU<->CPU), so no engine serves with this
tier here; the scheduler side below is all of it that runs without a GPU (docs/vllm.md)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch

from conftest import require_vllm

require_vllm()

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (  # noqa: E402
    OffloadingEventsTracker,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    Medium,
    OffloadingEvent,
    get_offload_block_hash,
    make_offload_key,
)

from kvtier.hosted import shelf as shelf_module  # noqa: E402
from kvtier.testing.engines import VllmOffloading  # noqa: E402
from kvtier.vllm.tier import KvtierTier  # noqa: E402

ROW_BYTES = 8192  # one chunk of every worker: a page multiple, as vLLM's region needs
CHUNKS = 8
# Each wait is a few file operations on this tier's threads: a bound for a busy machine.
WAIT_S = 30.0


def Engine(tier_settings: dict, tp_size: int = 1) -> VllmOffloading:  # noqa: N802
    return VllmOffloading(tier_settings, ROW_BYTES, CHUNKS, tp_size, wait_s=WAIT_S)


@pytest.fixture
def engines() -> Iterator[list[VllmOffloading]]:
    made: list[VllmOffloading] = []
    yield made
    for engine in made:
        engine.close()


def keys_of(*ids: int):
    return [make_offload_key(bytes([i]) * 32, 0) for i in ids]


def rows_like(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, ROW_BYTES), dtype=torch.uint8, generator=gen)


# The file store reads on its own threads (a load is handed to them at once); the memory
# store does not (a load runs on the tier's threads).
@pytest.mark.parametrize("backend", ["file", "memory"])
def test_vllm_builds_the_tier_and_promotes_its_chunks_byte_exact(tmp_path, engines, backend):
    storage = (
        {"backend": "file", "root": str(tmp_path)} if backend == "file" else {"backend": backend}
    )
    engine = Engine({"storage": storage, "enable_kv_events": True})
    engines.append(engine)
    assert isinstance(engine.tier, KvtierTier)  # built by vLLM's SecondaryTierFactory
    assert engine.tier._shelf.starts_transfers == (backend == "file")
    keys, data = keys_of(1, 2, 3), rows_like(3, seed=1)
    engine.offload(keys, data)
    assert engine.tier.stats()["objects"] == 3
    stored = [e for e in engine.manager.take_events() if e.medium is Medium.STORAGE]
    assert stored == [OffloadingEvent(keys, Medium.STORAGE, False, None)]

    engine.forget_cpu()
    assert engine.find(keys) == [LookupResult.HIT] * 3  # promoted from the tier
    assert torch.equal(engine.cpu_rows(keys), data)
    assert engine.tier.stats()["hits"] == 3
    assert engine.find(keys_of(9)) == [LookupResult.MISS]


def test_a_stale_weight_version_gets_no_hit(tmp_path, engines, monkeypatch):
    monkeypatch.setattr(shelf_module, "VERSION_CHECK_S", 0.0)
    model = tmp_path / "model"
    model.mkdir()
    (model / "version.yaml").write_text("version: RL-STEP4-20261207-aaa\n")
    engine = Engine({"storage": {"backend": "file", "root": str(tmp_path / "s")},
                     "model_dir": str(model)})  # fmt: skip
    engines.append(engine)
    keys = keys_of(1, 2)
    engine.offload(keys, rows_like(2, seed=2))
    engine.forget_cpu()
    (model / "version.yaml").write_text("version: RL-STEP5-20261207-bbb\n")
    os.utime(model / "version.yaml", ns=(1, 1))
    assert engine.find(keys) == [LookupResult.MISS] * 2


def test_a_corrupt_object_is_a_miss_never_bytes(tmp_path, engines):
    engine = Engine({"storage": {"backend": "file", "root": str(tmp_path)}})
    engines.append(engine)
    keys, data = keys_of(1, 2, 3), rows_like(3, seed=3)
    engine.offload(keys, data)
    shelf = engine.tier._shelf
    bad = shelf.keys([keys[1]])[0]
    raw = bytearray(shelf.backend.read_object(bad))
    raw[-1] ^= 0x40
    shelf.backend.write_object(bad, bytes(raw))
    engine.forget_cpu()
    results = engine.find(keys)
    assert results[0] is LookupResult.HIT and results[1] is LookupResult.MISS
    assert torch.equal(engine.cpu_rows(keys[:1]), data[:1])
    assert shelf.backend.stats.corrupt == 1


def test_another_parallel_geometry_never_reads_these_chunks(tmp_path, engines):
    storage = {"storage": {"backend": "file", "root": str(tmp_path)}}
    one = Engine(storage)
    engines.append(one)
    keys = keys_of(1, 2)
    one.offload(keys, rows_like(2, seed=4))
    two = Engine(storage, tp_size=2)  # the same row size, split over two workers
    engines.append(two)
    assert two.find(keys) == [LookupResult.MISS] * 2
    assert one.tier._shelf.keys(keys) != two.tier._shelf.keys(keys)


def test_the_bound_holds_and_evictions_are_events(tmp_path, engines):
    capacity = 4 * (ROW_BYTES + 4096)
    engine = Engine({"storage": {"backend": "file", "root": str(tmp_path),
                                 "capacity_bytes": capacity},
                     "enable_kv_events": True})  # fmt: skip
    engines.append(engine)
    for batch in range(4):
        keys = keys_of(*range(10 * batch, 10 * batch + 3))
        engine.offload(keys, rows_like(3, seed=batch))
        engine.forget_cpu()
    stats = engine.tier.stats()
    assert stats["used_bytes"] <= capacity and stats["evictions"] > 0
    events = [e for e in engine.manager.take_events() if e.medium is Medium.STORAGE]
    removed = [k for e in events if e.removed for k in e.keys]
    stored = [k for e in events if not e.removed for k in e.keys]
    assert len(removed) == stats["evictions"] and len(stored) == 12
    assert len(stored) - len(removed) == stats["objects"]

    # As vLLM's connector publishes them: its tracker turns them into KV events for routers,
    # sent as msgpack and decoded with its own classes.
    tracker = OffloadingEventsTracker(engine.spec.kv_events_config)
    batch = KVEventBatch(ts=time.time(), events=list(tracker.take_events(events)))
    decoded = msgspec.msgpack.Decoder(KVEventBatch).decode(msgspec.msgpack.encode(batch))
    hashes = {
        "stored": [h for e in decoded.events if isinstance(e, BlockStored) for h in e.block_hashes],
        "removed": [
            h for e in decoded.events if isinstance(e, BlockRemoved) for h in e.block_hashes
        ],
    }

    def as_event(keys: list) -> list:  # the hash form vLLM's events carry
        return sorted(maybe_convert_block_hash(get_offload_block_hash(k)) for k in keys)

    assert sorted(hashes["stored"]) == as_event(stored)
    assert sorted(hashes["removed"]) == as_event(removed)
    assert {e.medium for e in decoded.events} == {"STORAGE"}


def test_a_bad_setting_names_its_field(tmp_path):
    with pytest.raises(ValueError, match=r"secondary_tiers\[KvtierTier\].colour"):
        Engine({"storage": {"backend": "file", "root": str(tmp_path)}, "colour": "red"})
