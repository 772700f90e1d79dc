"""The vLLM connector's two sides without an engine: vLLM's own Request, SchedulerOutput and
KVCacheBlocks objects drive the scheduler side, and the worker side's step transfers run as
real kvtier tasks on an in-process worker (``local://``, memory store). Every step a real
engine takes is here: lookup, allocation, the step's metadata, saves, fences, loads, a load
that fails, a load in flight that another request waits for. The real-engine tests
(``test_vllm.py``) stay for what only an engine shows.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

from conftest import fill_random, require_vllm
from worker_helpers import WSPEC, block, local_worker, same

require_vllm()

from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

import kvtier.vllm.scheduler as scheduler_module  # noqa: E402
from kvtier.engine.client import Client  # noqa: E402
from kvtier.transport import tasks as t  # noqa: E402
from kvtier.vllm import decide  # noqa: E402
from kvtier.vllm.decide import LoadOrRecompute  # noqa: E402
from kvtier.vllm.metadata import REPORT_WAITING_S  # noqa: E402
from kvtier.vllm.scheduler import SchedulerSide  # noqa: E402
from kvtier.vllm.settings import ConnectorSettings  # noqa: E402
from kvtier.vllm.transfers import StepTransfers  # noqa: E402
from vllm import SamplingParams  # noqa: E402

BS = WSPEC.block_size  # 16 tokens per block, as the worker's spec
PROMPT = 100  # tokens: 6 full blocks; the last token's block is always computed
init_none_hash(sha256_cbor)
HASHER = get_request_block_hasher(BS, sha256_cbor)


def request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, block_hasher=HASHER)


def blocks(ids: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def step(new: list[tuple[Request, list[int], int]], scheduled: dict[str, int]) -> SchedulerOutput:
    """A step scheduling ``new`` requests (request, block ids, computed tokens)."""
    return SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(
                req_id=r.request_id,
                prompt_token_ids=r.prompt_token_ids,
                mm_features=[],
                sampling_params=r.sampling_params,
                pooling_params=None,
                block_ids=(ids,),
                num_computed_tokens=done,
                lora_request=None,
            )
            for r, ids, done in new
        ],
        scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(),
        free_encoder_mm_hashes=[],
        num_common_prefix_blocks=[0],
    )


def decode_step(req: Request, computed: int, new_ids: list[int] | None = None) -> SchedulerOutput:
    """A step decoding one token of a running request."""
    cached = CachedRequestData(
        req_ids=[req.request_id],
        resumed_req_ids=set(),
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[(new_ids,) if new_ids else None],
        num_computed_tokens=[computed],
        num_output_tokens=[req.num_output_tokens],
    )
    out = step([], {req.request_id: 1})
    out.scheduled_cached_reqs = cached
    return out


def until(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the connector never got there"
        time.sleep(0.005)


SLOW_STORE = {"backend": "memory", "faults": {"latency_s": 0.1}}
SLOW_TRANSFERS = {"transfer_latency_s": 0.6}


@pytest.fixture
def connector(request):
    """A worker in this process, the scheduler side and one rank's step transfers on it
    (``@pytest.mark.parametrize("connector", [{settings}], indirect=True)`` changes its
    settings)."""
    param = dict(getattr(request, "param", {}))
    storage = {"storage": param.pop("worker_storage")} if "worker_storage" in param else {}
    worker = local_worker("cn", num_host_blocks=1, staging_blocks=4, **storage)
    config = worker.config
    extra = {"start_timeout_s": 10, **param}
    settings = ConnectorSettings.from_extra_config(extra)
    scheduler = SchedulerSide(
        config.instance_id, 1, BS, settings, endpoints=[config.endpoint_address]
    )
    transfers = StepTransfers(BS)
    transfers.client = Client.connect([config.endpoint_address], start_timeout_s=10)
    fill_random(worker.resources.device_cache, 1)  # "computed KV" in every device block
    yield scheduler, transfers, worker
    transfers.client.close()
    scheduler.close()
    worker.close()


def compute_and_save(scheduler, transfers, req: Request, ids: list[int]) -> None:
    """The request's first step: prefill computes everything; its full blocks are saved."""
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    scheduler.update_state_after_alloc(req, blocks(ids), 0)
    meta = scheduler.build_connector_meta(step([(req, ids, 0)], {req.request_id: PROMPT}))
    assert [s.block_ids for s in meta.saves] == [ids[:6]]  # 6 full prompt blocks
    transfers.start_load_kv(meta)
    transfers.wait_for_save(meta)
    assert scheduler.request_finished(req) == (True, None)  # fenced: its saves are in flight
    until(lambda: transfers.get_finished({req.request_id})[0] == {req.request_id})


def stored_then_evicted(connector, first_token: int, gone: slice, in_step: bool):
    """r1 computes and saves a prompt; r2 finds it stored (to load within its step or not);
    then the objects of blocks ``gone`` are evicted, as after a lookup. (r1, r2)."""
    scheduler, transfers, worker = connector
    tokens = list(range(first_token, first_token + PROMPT))
    first = request("r1", tokens)
    compute_and_save(scheduler, transfers, first, list(range(0, 7)))
    second = request("r2", tokens)
    assert scheduler.get_num_new_matched_tokens(second, 0) == (6 * BS, not in_step)
    hashes = list(first.block_hashes[gone])
    assert worker.resources.storage.delete(worker.resources.keys.keys(hashes)) == len(hashes)
    return first, second


def test_a_prefix_computed_once_is_loaded_by_the_next_request(connector) -> None:
    scheduler, transfers, worker = connector
    cache = worker.resources.device_cache
    tokens = list(range(1000, 1000 + PROMPT))
    first = request("r1", tokens)
    compute_and_save(scheduler, transfers, first, list(range(0, 7)))
    stats = transfers.take_stats().data
    assert stats["saved_tokens"] == 6 * BS and stats.get("skipped_tokens", 0) == 0

    second = request("r2", tokens)
    assert scheduler.get_num_new_matched_tokens(second, 0) == (6 * BS, True)  # async load
    ids = list(range(10, 17))
    scheduler.update_state_after_alloc(second, blocks(ids), 6 * BS)
    meta = scheduler.build_connector_meta(step([(second, ids, 6 * BS)], {"r2": PROMPT - 96}))
    assert [(s.req_id, s.block_ids) for s in meta.loads] == [("r2", ids[:6])]
    assert meta.saves == []  # stored already: not submitted again
    transfers.start_load_kv(meta)
    until(lambda: "r2" in transfers.get_finished(set())[1])
    scheduler.update_connector_output(KVConnectorOutput(finished_recving={"r2"}))
    assert all(same(block(cache, 10 + i), block(cache, i)) for i in range(6))  # vLLM's bytes
    assert transfers.load_errors() == set()
    stats = transfers.take_stats().data
    assert stats["loaded_tokens"] == 6 * BS and stats["found_tokens"] == 6 * BS
    assert stats["lookups"] == 1 and stats["requested_tokens"] == 6 * BS  # this step's


@pytest.mark.parametrize("connector", [{}, {"load_mode": "sync"}], indirect=True)
def test_a_load_within_the_step_is_in_vllms_blocks_before_the_forward(connector) -> None:
    """``load_mode: sync``, or ``auto`` (the default) once the store's loads are measured
    shorter than a step: the load is not announced asynchronous, ``start_load_kv`` returns with
    the bytes in vLLM's blocks, and the next request is not kept waiting."""
    scheduler, transfers, worker = connector
    cache = worker.resources.device_cache
    tokens = list(range(1500, 1500 + PROMPT))
    compute_and_save(scheduler, transfers, request("r1", tokens), list(range(0, 7)))
    if scheduler.load_mode == "auto":
        unknown = request("r2", tokens)
        assert scheduler.get_num_new_matched_tokens(unknown, 0) == (6 * BS, True)  # rates unknown
        scheduler.request_finished(unknown)
        for n in (2, 4, 6):
            scheduler.decide.loaded(n, 0.0002 * n)  # a fast store, as its loads measured it
        for i in range(4):
            scheduler.decide.step(128, 100.0 + 0.02 * i)  # 20 ms steps
    second = request("r3", tokens)
    assert scheduler.get_num_new_matched_tokens(second, 0) == (6 * BS, False)
    ids = list(range(10, 17))
    scheduler.update_state_after_alloc(second, blocks(ids), 6 * BS)
    meta = scheduler.build_connector_meta(step([(second, ids, 96)], {"r3": 4}))
    assert [(s.req_id, s.sync) for s in meta.loads] == [("r3", True)]
    assert meta.lookup_counts["in_step_loaded_tokens"] == 6 * BS
    transfers.start_load_kv(meta)  # returns once the step's forward may read the blocks
    assert all(same(block(cache, 10 + i), block(cache, i)) for i in range(6))
    assert transfers.get_finished(set())[1] == set()  # not an asynchronous receive
    assert transfers.take_stats().data["loaded_tokens"] == 6 * BS
    # Fenced at its end, as every request that loaded within a step (such a load may outlive
    # its step), and reported sent at once: its load was answered.
    assert scheduler.request_finished(second) == (True, None)
    assert transfers.get_finished({"r3"}) == ({"r3"}, set())
    scheduler.build_connector_meta(step([], {}))  # the next step: the load is over
    assert scheduler.get_num_new_matched_tokens(request("r4", tokens), 0) == (6 * BS, False)


@pytest.mark.parametrize(
    "connector",
    [{"load_mode": "sync", "worker_storage": {"backend": "memory", "faults": SLOW_TRANSFERS}}],
    indirect=True,
)
def test_a_load_that_fails_slowly_still_says_how_slow_its_tier_is(connector) -> None:
    """Objects gone after the lookup, behind a store that takes 0.6 s a transfer: the load
    fails after 0.6 s and is a sample of its tier all the same (a failed load is no sample
    of how fast a tier is, a slow one is a floor) — else a tier that stalls and fails would
    keep being loaded from within the step, each load holding the whole step."""
    scheduler, transfers, worker = connector
    first, second = stored_then_evicted(connector, 1700, slice(0, 6), in_step=True)
    ids = list(range(10, 17))
    scheduler.update_state_after_alloc(second, blocks(ids), 6 * BS)
    transfers.start_load_kv(scheduler.build_connector_meta(step([(second, ids, 96)], {"r2": 4})))
    assert transfers.load_errors() == set(ids[:6])  # vLLM recomputes them
    meta = transfers.worker_meta()
    assert [n for n, _ in meta.load_times] == [(6,)] and meta.load_times[0][1] >= 0.6
    scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=meta))
    assert scheduler.decide.store.samples == 1


@pytest.mark.parametrize(
    "connector",
    [{"worker_storage": {"backend": "memory", "faults": {"transfer_latency_s": 1.0}}}],
    indirect=True,
)
def test_loads_within_the_step_whose_store_stalls_hold_the_step_no_longer_than_its_wait(
    connector, monkeypatch
) -> None:
    """``auto`` chose two loads within one step from a store measured fast, and the store then
    stalls (1 s a transfer): the step waits ``IN_STEP_WAIT_S`` (0.3 s here) for both together,
    not until they are answered (``task_timeout_s``, 120 s by default). vLLM recomputes their
    blocks, the wait is a sample of the tier, and each request, fenced at its end, is reported
    sent only once its load is answered: the load may still write its own request's blocks
    (with the same tokens' KV)."""
    monkeypatch.setattr(scheduler_module, "IN_STEP_WAIT_S", 0.3)
    scheduler, transfers, worker = connector
    cache = worker.resources.device_cache
    prompts = [list(range(5200, 5200 + PROMPT)), list(range(6300, 6300 + PROMPT))]
    for name, tokens, ids in zip(("r1", "r1b"), prompts, (range(0, 7), range(7, 14))):
        compute_and_save(scheduler, transfers, request(name, tokens), list(ids))
    for n in (2, 4, 6):
        scheduler.decide.loaded(n, 0.0002 * n)  # measured fast before it stalled
    for i in range(4):
        scheduler.decide.step(128, 100.0 + 0.02 * i)
    second, third = request("r2", prompts[0]), request("r3", prompts[1])
    ids = {"r2": list(range(14, 21)), "r3": list(range(21, 28))}
    for r in (second, third):
        assert scheduler.get_num_new_matched_tokens(r, 0) == (6 * BS, False)
        scheduler.update_state_after_alloc(r, blocks(ids[r.request_id]), 6 * BS)
    new = [(r, ids[r.request_id], 96) for r in (second, third)]
    meta = scheduler.build_connector_meta(step(new, {"r2": 4, "r3": 4}))
    assert [(s.sync, s.wait_s) for s in meta.loads] == [(True, 0.3)] * 2
    start = time.monotonic()
    transfers.start_load_kv(meta)
    waited = time.monotonic() - start
    assert 0.3 <= waited < 0.6, waited  # one wait for both (not one each), not the store's 1 s
    assert transfers.load_errors() == set(ids["r2"][:6] + ids["r3"][:6])  # vLLM recomputes
    worker_meta = transfers.worker_meta()
    assert worker_meta.failed_hashes == set(second.block_hashes[:6] + third.block_hashes[:6])
    assert [n for n, _ in worker_meta.load_times] == [(6,), (6,)]
    assert min(seconds for _, seconds in worker_meta.load_times) >= 0.3
    for r in (second, third):
        assert scheduler.request_finished(r) == (True, None)  # fenced: the loads go on
    assert transfers.get_finished({"r2", "r3"}) == (set(), set())
    sent: set[str] = set()
    until(lambda: sent.update(transfers.get_finished(set())[0]) or sent == {"r2", "r3"})
    assert time.monotonic() - start >= 2.0  # the second load was answered after the first
    assert all(same(block(cache, 14 + i), block(cache, i)) for i in range(6))
    assert all(same(block(cache, 21 + i), block(cache, 7 + i)) for i in range(6))
    assert transfers.take_stats().data["failed_tokens"] == 12 * BS


@pytest.mark.parametrize("connector", [{"load_mode": "sync"}], indirect=True)
def test_blocks_whose_load_within_the_step_failed_are_saved_once_recomputed(connector) -> None:
    """The request ran in the step of its load, with the blocks counted computed (its saves
    moved past them); the load failed, and vLLM recomputes them in the next step: that step
    saves them again, so the next request hits them."""
    scheduler, transfers, worker = connector
    first, second = stored_then_evicted(connector, 3500, slice(2, 6), in_step=True)
    ids = list(range(20, 27))
    scheduler.update_state_after_alloc(second, blocks(ids), 6 * BS)
    meta = scheduler.build_connector_meta(step([(second, ids, 96)], {"r2": 4}))
    assert meta.saves == []  # all stored, as far as the scheduler knows
    transfers.start_load_kv(meta)
    assert transfers.load_errors() == set(ids[2:6])
    scheduler.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=transfers.worker_meta())
    )
    recompute = step([], {"r2": PROMPT - 2 * BS})  # vLLM resumes it after the loaded prefix
    recompute.scheduled_cached_reqs = CachedRequestData(
        req_ids=["r2"],
        resumed_req_ids=set(),
        new_token_ids=[],
        all_token_ids={},
        new_block_ids=[None],
        num_computed_tokens=[2 * BS],
        num_output_tokens=[0],
    )
    meta = scheduler.build_connector_meta(recompute)
    assert [(s.block_hashes, s.block_ids) for s in meta.saves] == [
        (list(first.block_hashes[2:6]), ids[2:6])
    ]


def test_a_request_waits_for_a_load_in_flight_then_hits_vllms_cache(connector) -> None:
    """Each object is loaded once: until r2's load is reported received, r3 with the same
    prefix waits (None) instead of loading the same objects again."""
    scheduler, transfers, worker = connector
    tokens = list(range(2000, 2000 + PROMPT))
    compute_and_save(scheduler, transfers, request("r1", tokens), list(range(0, 7)))
    second, third = request("r2", tokens), request("r3", tokens)
    assert scheduler.get_num_new_matched_tokens(second, 0) == (6 * BS, True)
    scheduler.update_state_after_alloc(second, blocks(list(range(10, 17))), 6 * BS)
    meta = scheduler.build_connector_meta(step([(second, list(range(10, 17)), 96)], {"r2": 4}))
    transfers.start_load_kv(meta)
    assert scheduler.get_num_new_matched_tokens(third, 0) == (None, False)
    assert scheduler.request_finished(second) == (True, None)  # its blocks are being written
    until(lambda: "r2" in transfers.get_finished({"r2"})[1])
    scheduler.update_connector_output(KVConnectorOutput(finished_recving={"r2"}))
    assert scheduler.get_num_new_matched_tokens(third, 0) == (6 * BS, True)  # no longer waits


def test_a_load_that_fails_is_recomputed_and_saved_again(connector) -> None:
    """Objects gone between the lookup and the load: the blocks past the loaded prefix are
    reported to vLLM (recomputed), and the scheduler submits them for saving again."""
    scheduler, transfers, worker = connector
    tokens = list(range(3000, 3000 + PROMPT))
    first, second = stored_then_evicted(connector, 3000, slice(2, 6), in_step=False)
    ids = list(range(20, 27))
    scheduler.update_state_after_alloc(second, blocks(ids), 6 * BS)
    meta = scheduler.build_connector_meta(step([(second, ids, 96)], {"r2": 4}))
    transfers.start_load_kv(meta)
    until(lambda: "r2" in transfers.get_finished(set())[1])
    assert transfers.load_errors() == set(ids[2:6])  # vLLM recomputes exactly these
    worker_meta = transfers.worker_meta()
    assert worker_meta.failed_hashes == set(first.block_hashes[2:6])
    scheduler.update_connector_output(
        KVConnectorOutput(finished_recving={"r2"}, kv_connector_worker_meta=worker_meta)
    )
    stats = transfers.take_stats().data
    assert stats["loaded_tokens"] == 2 * BS and stats["failed_tokens"] == 4 * BS
    assert stats["tier0_loaded_tokens"] == 2 * BS  # one backend: its only tier
    # The next request computes them and saves them again (the scheduler forgot them).
    third = request("r3", tokens)
    assert scheduler.get_num_new_matched_tokens(third, 0) == (2 * BS, True)
    scheduler.update_state_after_alloc(third, blocks(list(range(30, 37))), 2 * BS)
    meta = scheduler.build_connector_meta(step([(third, list(range(30, 37)), 32)], {"r3": 68}))
    assert [s.block_hashes for s in meta.saves] == [list(first.block_hashes[2:6])]


@pytest.mark.parametrize(
    ("connector", "declines"),
    [
        ({"worker_storage": SLOW_STORE}, True),
        ({"worker_storage": SLOW_STORE, "load_or_recompute": False}, False),
    ],
    indirect=["connector"],
)
def test_a_store_slower_than_recompute_is_declined_from_measured_loads(connector, declines) -> None:
    """Loads measured through the real path (worker metadata) take 0.1 s or more each; the
    engine's steps take microseconds here: the next hit is not loaded (not even looked up,
    counted), or loaded when the decision is switched off."""
    scheduler, transfers, worker = connector
    tokens = list(range(6000, 6000 + PROMPT))
    compute_and_save(scheduler, transfers, request("r0", tokens), list(range(0, 7)))
    for n in range(1, 4):
        req = request(f"r{n}", tokens)
        assert scheduler.get_num_new_matched_tokens(req, 0) == (6 * BS, True)
        ids = list(range(10 * n, 10 * n + 7))
        scheduler.update_state_after_alloc(req, blocks(ids), 6 * BS)
        meta = scheduler.build_connector_meta(step([(req, ids, 96)], {req.request_id: 100}))
        transfers.start_load_kv(meta)
        until(lambda req_id=req.request_id: req_id in transfers.get_finished(set())[1])
        scheduler.update_connector_output(
            KVConnectorOutput(
                finished_recving={req.request_id}, kv_connector_worker_meta=transfers.worker_meta()
            )
        )
        scheduler.request_finished(req)
    for i in range(20):  # the engine's steps, back to back as in a running engine
        scheduler.build_connector_meta(step([], {"busy": 64 * (1 + i % 3)}))
    assert scheduler.decide.store.samples == 3
    assert scheduler.decide.estimates()["tier0_load_s_per_block"] * 6 >= 0.1
    late = request("r9", tokens)
    if declines:
        assert scheduler.get_num_new_matched_tokens(late, 0) == (0, False)
        meta = scheduler.build_connector_meta(step([], {}))
        # Every length of it would be declined (a step takes microseconds here, so nothing is
        # under the always-take floor): not even looked up.
        assert meta.lookup_counts["lookups_skipped"] == 1
    else:
        assert scheduler.get_num_new_matched_tokens(late, 0) == (6 * BS, True)
    # New prompts: the first is saved (a probe of the store); the second, within STALE_S, is
    # saved only when its load would be taken — else it is counted unsaved, never fenced.
    saves = []
    for n, first in ((10, 7000), (11, 7200)):
        req = request(f"r{n}", list(range(first, first + PROMPT)))
        assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        scheduler.update_state_after_alloc(req, blocks(list(range(7))), 0)
        meta = scheduler.build_connector_meta(step([(req, list(range(7)), 0)], {f"r{n}": PROMPT}))
        saves.append([len(s.block_hashes) for s in meta.saves])
        assert scheduler.request_finished(req)[0] == bool(meta.saves)  # fenced iff saved
    counts = scheduler.build_connector_meta(step([], {})).lookup_counts  # the step's counts
    if declines:
        assert saves == [[6], []] and counts["unsaved_tokens"] == 6 * BS
    else:
        assert saves == [[6], [6]] and "unsaved_tokens" not in counts


def test_no_lookup_while_every_hit_would_be_declined_but_for_a_probe(connector) -> None:
    """A store whose loads cost 1 s before their first byte, an engine that recomputes in
    microseconds: no stored prefix of any length would be loaded, so no lookup makes vLLM's
    loop wait (``lookups_skipped``) — until the store is due for a probe."""
    scheduler, transfers, worker = connector
    tokens = list(range(6500, 6500 + PROMPT))
    compute_and_save(scheduler, transfers, request("r0", tokens), list(range(0, 7)))
    for i in range(20):  # the engine's steps, back to back as in a running engine
        scheduler.build_connector_meta(step([], {"busy": 64 * (1 + i % 3)}))
    for n in (2, 4, 8):
        scheduler.decide.loaded(n, 1.0 + 0.001 * n)
    round_trips(scheduler)
    assert scheduler.get_num_new_matched_tokens(request("r1", tokens), 0) == (0, False)
    counts = scheduler.build_connector_meta(step([], {})).lookup_counts
    assert counts["lookups_skipped"] == 1 and counts["requested_tokens"] == 6 * BS
    assert "lookup_round_trips" not in counts
    scheduler.decide.store.at -= decide.PROBE_S  # due for a probe: looked up and loaded
    assert scheduler.get_num_new_matched_tokens(request("r2", tokens), 0) == (6 * BS, True)
    counts = scheduler.build_connector_meta(step([], {})).lookup_counts
    assert counts["lookup_round_trips"] == 1 and "lookups_skipped" not in counts


def test_a_lost_worker_costs_a_recompute_never_a_hang(connector) -> None:
    scheduler, transfers, worker = connector
    tokens = list(range(4000, 4000 + PROMPT))
    compute_and_save(scheduler, transfers, request("r1", tokens), list(range(0, 7)))
    second = request("r2", tokens)
    assert scheduler.get_num_new_matched_tokens(second, 0) == (6 * BS, True)
    scheduler.update_state_after_alloc(second, blocks(list(range(10, 17))), 6 * BS)
    meta = scheduler.build_connector_meta(step([(second, list(range(10, 17)), 96)], {"r2": 4}))
    transfers.client.close()  # the worker's client is gone: every task fails at once
    transfers.start_load_kv(meta)
    until(lambda: "r2" in transfers.get_finished(set())[1])
    assert transfers.load_errors() == set(range(10, 16))


def test_a_configuration_error_is_one_clear_line_before_vllms_traceback(caplog) -> None:
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.errors import ConfigError
    from kvtier.vllm import KvtierConnector

    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config={"colour": "red"})
    )
    with pytest.raises(ConfigError):
        KvtierConnector(config, KVConnectorRole.SCHEDULER, None)
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert line.startswith("kvtier: invalid configuration: kv_connector_extra_config.colour:")


def round_trips(scheduler) -> int:
    """Lookups the scheduler sent to the workers since the last step's metadata."""
    meta = scheduler.build_connector_meta(step([], {}))
    return meta.lookup_counts.get("lookup_round_trips", 0)


def test_a_waiting_request_is_looked_up_once(connector, monkeypatch) -> None:
    """vLLM asks on every scheduling attempt while a request waits for blocks: one round trip
    answers them all, shortened where vLLM's own cache now covers more; a reset (a weight
    update), a failed load and the age bound each make the next ask a new lookup."""
    scheduler, transfers, worker = connector
    tokens = list(range(5000, 5000 + PROMPT))
    compute_and_save(scheduler, transfers, request("r1", tokens), list(range(0, 7)))
    round_trips(scheduler)
    waiting = request("r2", tokens)
    for _ in range(5):  # no free blocks yet: vLLM asks again each step
        assert scheduler.get_num_new_matched_tokens(waiting, 0) == (6 * BS, True)
    assert round_trips(scheduler) == 1
    # vLLM's own prefix cache now holds the first 2 blocks: kvtier offers the other 4.
    assert scheduler.get_num_new_matched_tokens(waiting, 2 * BS) == (4 * BS, True)
    assert round_trips(scheduler) == 0
    assert scheduler.reset_cache() is True  # after a weight update: ask again
    assert scheduler.get_num_new_matched_tokens(waiting, 0) == (6 * BS, True)
    assert round_trips(scheduler) == 1
    monkeypatch.setattr("kvtier.vllm.scheduler.LOOKUP_REUSE_S", 0.0)
    time.sleep(0.01)
    assert scheduler.get_num_new_matched_tokens(waiting, 0) == (6 * BS, True)
    assert round_trips(scheduler) == 1
    # Allocated: a later ask (after a preemption) is a new question.
    monkeypatch.setattr("kvtier.vllm.scheduler.LOOKUP_REUSE_S", 60.0)
    scheduler.get_num_new_matched_tokens(waiting, 0)
    scheduler.update_state_after_alloc(waiting, blocks(list(range(10, 17))), 0)
    round_trips(scheduler)
    scheduler.get_num_new_matched_tokens(waiting, 0)
    assert round_trips(scheduler) == 1


def test_a_lookup_counts_how_long_vllms_loop_waited_for_its_answer(connector) -> None:
    """``lookup_microseconds``: each round trip's wait, within the call that made it; an ask
    answered from a kept lookup adds nothing."""
    scheduler, transfers, worker = connector
    round_trips(scheduler)
    waiting = request("w1", list(range(9000, 9000 + PROMPT)))
    started = time.monotonic()
    assert scheduler.get_num_new_matched_tokens(waiting, 0) == (0, False)
    took_us = (time.monotonic() - started) * 1e6
    counts = scheduler.build_connector_meta(step([], {})).lookup_counts
    assert counts["lookup_round_trips"] == 1
    assert 0 < counts["lookup_microseconds"] <= took_us
    assert scheduler.get_num_new_matched_tokens(waiting, 0) == (0, False)  # the kept answer
    counts = scheduler.build_connector_meta(step([], {})).lookup_counts
    assert counts.get("lookup_round_trips", 0) == 0 and counts.get("lookup_microseconds", 0) == 0


def test_a_steps_saves_go_to_the_worker_as_one_task(connector) -> None:
    scheduler, transfers, worker = connector
    reqs = [
        request(f"s{i}", list(range(6000 + 1000 * i, 6000 + 1000 * i + PROMPT))) for i in range(3)
    ]
    new = []
    for i, req in enumerate(reqs):
        assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
        ids = list(range(7 * i, 7 * i + 7))
        scheduler.update_state_after_alloc(req, blocks(ids), 0)
        new.append((req, ids, 0))
    meta = scheduler.build_connector_meta(step(new, {r.request_id: PROMPT for r in reqs}))
    assert len(meta.saves) == 3
    before = worker.stats()["tasks"].get("save", {})
    transfers.wait_for_save(meta)
    for req in reqs:
        assert scheduler.request_finished(req) == (True, None)
    ids = {r.request_id for r in reqs}
    done: set[str] = set()
    until(lambda: done.update(transfers.get_finished(ids)[0]) or done == ids)
    stats = transfers.take_stats().data
    assert stats["save_tasks"] == 1 and stats["saved_tokens"] == 3 * 6 * BS
    after = worker.stats()["tasks"]["save"]
    assert after["tasks"] - before.get("tasks", 0) == 1
    assert after["blocks_written"] - before.get("blocks_written", 0) == 18


@pytest.mark.parametrize("connector", [{}, {"save_generated": False}], indirect=True)
def test_full_blocks_of_generated_tokens_are_saved_for_the_next_turn(connector) -> None:
    """A chat's next turn is the earlier prompt + the answer + a new message: with
    ``save_generated`` (the default) the answer's full blocks are saved as decode fills them,
    and the next turn hits them; without it only the prompt's are."""
    scheduler, transfers, worker = connector
    tokens = list(range(7000, 7000 + PROMPT))
    answer = [42 + j for j in range(2 * BS)]  # 32 tokens: 132 in all, 8 full blocks
    turn, ids = request("t1", tokens), list(range(0, 9))
    assert scheduler.get_num_new_matched_tokens(turn, 0) == (0, False)
    scheduler.update_state_after_alloc(turn, blocks(ids[:7]), 0)
    transfers.wait_for_save(
        scheduler.build_connector_meta(step([(turn, ids[:7], 0)], {"t1": PROMPT}))
    )
    for k, token in enumerate(answer):  # each decode step computes one more token's KV
        turn.append_output_token_ids(token)
        computed = PROMPT + k
        new_ids = [ids[computed // BS]] if computed % BS == 0 else None
        transfers.wait_for_save(
            scheduler.build_connector_meta(decode_step(turn, computed, new_ids))
        )
    assert scheduler.request_finished(turn) == (True, None)  # its saves may be in flight
    until(lambda: transfers.get_finished({"t1"})[0] == {"t1"})
    second = request("t2", tokens + answer + list(range(9000, 9040)))
    found, _ = scheduler.get_num_new_matched_tokens(second, 0)
    assert found == (8 if scheduler.settings.save_generated else 6) * BS


def test_a_saves_sample_leaves_out_its_threads_waits_for_a_core() -> None:
    """A save answered after 2 s of which its niced thread waited 1.9 s for a core (a busy
    machine) is a sample of 0.1 s: no slow-store floor under the first tier."""
    transfers = StepTransfers(BS)
    future: Future = Future()
    blocks = [0, 1, 2, 3, 4]
    future.set_result(
        t.Result(task_id=1, status=t.Status.OK, blocks=blocks, seconds=2.0, cpu_wait_s=1.9)
    )
    transfers._account_save(future, [bytes([i]) * 32 for i in range(5)])
    meta = transfers.worker_meta()
    assert meta is not None and meta.save_times == [(5, pytest.approx(0.1))]
    decision = LoadOrRecompute(BS)
    decision.saved(*meta.save_times[0])
    assert decision._floors() == (0.0, 0.0)
    decision.saved(5, 2.0)  # the same save without the waits: 0.4 s per block of its own
    assert decision._floors() == (0.0, 0.4)


@pytest.mark.parametrize(
    "connector",
    [{"worker_storage": {"backend": "memory", "faults": {"transfer_latency_s": 1.5}}}],
    indirect=True,
)
def test_a_save_blocked_on_its_store_is_reported_before_its_answer(connector) -> None:
    """A save that waits on its store (1.5 s a transfer) is reported to the scheduler while
    it is unanswered: its blocks and its time blocked on the store, as the kvtier worker's save
    watch measures it (``test_save_watch.py``: not its waits for a core) and its heartbeats
    carry. With no load measured, the report declines the store."""
    scheduler, transfers, worker = connector
    for i in range(decide.ENGINE_MIN_STEPS + 2):  # a measured engine: prefills of ms
        scheduler.build_connector_meta(step([], {"busy": 64 * (1 + i % 3)}))
        time.sleep(0.002)
    req = request("r1", list(range(8000, 8000 + PROMPT)))
    ids = list(range(0, 7))
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    scheduler.update_state_after_alloc(req, blocks(ids), 0)
    meta = scheduler.build_connector_meta(step([(req, ids, 0)], {req.request_id: PROMPT}))
    submitted = time.monotonic()
    transfers.wait_for_save(meta)
    reports: list = []

    def reported() -> bool:
        out = transfers.worker_meta()
        if out is not None and out.waiting_saves:
            reports.append((out, time.monotonic() - submitted))
        return bool(reports)

    until(reported)
    out, age = reports[0]
    ((blocks_waiting, blocked_s),) = out.waiting_saves
    assert blocks_waiting == 6 and REPORT_WAITING_S <= blocked_s <= age
    scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=out))
    assert scheduler.decide.blocks_to_load(6) == 0  # 6 blocks, > 0.08 s each, vs ms
    until(lambda: transfers.get_finished({req.request_id})[0] == {req.request_id})


def test_the_scheduler_side_sees_the_storage_the_workers_run(monkeypatch) -> None:
    """``KVTIER_STORAGE*`` reaches the workers through the launcher's merge; the scheduler's
    tier count and the KV events' backend name read the same merge, not the file default."""
    monkeypatch.setenv(
        "KVTIER_STORAGE", "{tiers: [{backend: memory}, {backend: file, root: /tmp/x}]}"
    )
    settings = ConnectorSettings.from_extra_config({})
    assert [b.backend for b in settings.storage_config.backends] == ["memory", "file"]
    assert settings.storage_config is settings.storage_config  # parsed once
    monkeypatch.delenv("KVTIER_STORAGE")
    monkeypatch.setenv("KVTIER_STORAGE_BACKEND", "memory")
    assert ConnectorSettings.from_extra_config({}).storage_config.backend == "memory"
    given = ConnectorSettings.from_extra_config({"storage": {"backend": "file", "root": "/y"}})
    assert given.storage_config.backend == "file"  # the connector's own setting wins
