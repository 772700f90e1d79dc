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
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import require_vllm

require_vllm()

from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    Medium,
    OffloadingEvent,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from kvtier.hosted import shelf as shelf_module  # noqa: E402
from kvtier.vllm.tier import KvtierTier, tier_config  # noqa: E402

ROW_BYTES = 8192  # one chunk of every worker: a page multiple, as vLLM's region needs
CHUNKS = 8
# Each wait is a few file operations on this tier's threads: a bound for a busy machine.
WAIT_S = 30.0
STEP = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())


class Engine:
    """vLLM's scheduler side of native offloading, built by vLLM from its configuration."""

    def __init__(self, tier_settings: dict, tp_size: int = 1, events: bool = True) -> None:
        self.engine_id = f"kvtiertest{uuid.uuid4().hex[:10]}"
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(16, ("layer.0", "layer.1"), 0),),
            worker_kv_bytes_per_block=ROW_BYTES // tp_size,
            enable_kv_cache_events=events,
            extra_config={
                "cpu_bytes_to_use": ROW_BYTES * CHUNKS,
                "secondary_tiers": [tier_config(**tier_settings)],
            },
            engine_id=self.engine_id,
            model=OffloadingModelConfig("org/model", "bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(0, tp_size, tp_size, 1, 1, 1, 0, 1, None, False),
        )
        self.spec = TieringOffloadingSpec(config)
        try:
            self.manager = self.spec.get_manager()
        except BaseException:
            self._unlink_region()
            raise
        self.tier = self.manager.secondary_tiers[0]
        assert isinstance(self.tier, KvtierTier)
        view = self.manager.primary_tier.get_kv_memoryview()
        self.rows = torch.frombuffer(view.cast("B"), dtype=torch.uint8).view(CHUNKS, -1)
        self._requests = 0

    def request(self) -> ReqContext:
        self._requests += 1
        ctx = ReqContext(req_id=f"r{self._requests}")
        self.manager.on_new_request(ctx)
        return ctx

    def offload(self, keys, data: torch.Tensor) -> None:
        """What vLLM does when blocks leave the GPU: CPU chunks, then the cascade to the tier."""
        ctx = self.request()
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == list(keys)
        for row, chunk in zip(data, out.store_spec.block_ids, strict=True):
            self.rows[chunk].copy_(row)
        self.manager.complete_store(keys, ctx)
        self.settle()

    def settle(self) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.tier.has_pending_work() or self.manager.has_pending_work():
            assert time.monotonic() < deadline, "the tier did not finish its jobs"
            self.manager.on_schedule_end(STEP)
            time.sleep(0.005)
        self.manager.on_schedule_end(STEP)

    def forget_cpu(self) -> None:
        """vLLM's reset (sleep, weight update): the CPU tier forgets; the tier keeps."""
        self.manager.reset_cache()
        self.rows.zero_()

    def find(self, keys) -> list[LookupResult]:
        """Look ``keys`` up as the scheduler does, step after step, until each is answered (a
        tier hit is promoted into the CPU tier first)."""
        ctx = self.request()
        deadline = time.monotonic() + WAIT_S
        while True:
            results = [self.manager.lookup(k, ctx) for k in keys]
            waiting = {LookupResult.RETRY, LookupResult.HIT_PENDING}
            if not waiting & set(results):
                return results
            assert time.monotonic() < deadline, f"lookups not answered: {results}"
            self.manager.on_schedule_end(STEP)
            time.sleep(0.005)

    def cpu_rows(self, keys) -> torch.Tensor:
        spec = self.manager.prepare_load(keys, self.request())
        return torch.stack([self.rows[c].clone() for c in spec.block_ids])

    def close(self) -> None:
        del self.rows
        self.manager.shutdown()
        self._unlink_region()

    def _unlink_region(self) -> None:
        # The scheduler's region, made by this test (no workers here to remove it).
        Path(f"/dev/shm/vllm_offload_{self.engine_id}.mmap").unlink(missing_ok=True)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def keys_of(*ids: int):
    return [make_offload_key(bytes([i]) * 32, 0) for i in ids]


def rows_like(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, ROW_BYTES), dtype=torch.uint8, generator=gen)


def test_vllm_builds_the_tier_and_promotes_its_chunks_byte_exact(tmp_path, engines):
    engine = Engine({"storage": {"backend": "file", "root": str(tmp_path)},
                     "enable_kv_events": True})  # fmt: skip
    engines.append(engine)
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


def test_a_bad_setting_names_its_field(tmp_path):
    with pytest.raises(ValueError, match=r"secondary_tiers\[KvtierTier\].colour"):
        Engine({"storage": {"backend": "file", "root": str(tmp_path)}, "colour": "red"})
