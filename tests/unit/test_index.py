"""CacheIndex against a simulated engine: random requests, finishes, evictions and failures.

The simulation keeps what every device and host block and the store *really* hold; after each
step the index's bookkeeping must be consistent and every block a request uses must hold the
right bytes (here: the right hash) — hits included.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.engine.index import (
    CacheIndex,
    Plan,
    SaveHostEviction,
    SwapOutEviction,
    Tier,
    WritePolicy,
)
from kvtier.errors import ConfigError, InvalidInput, NoFreeBlocks

BLOCK = 4
# Requests share prefixes: a "system prompt", then one of a few histories, then a turn.
SYSTEM = list(range(100, 108))
HISTORIES = [list(range(200 + 10 * i, 208 + 10 * i)) for i in range(3)]


def tokens_for(history: int, turn: int, length: int) -> list[int]:
    return SYSTEM + HISTORIES[history] + [1000 + turn * 50 + j for j in range(length)]


class Engine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.index: CacheIndex | None = None
        self.device: dict[int, bytes] = {}
        self.host: dict[int, bytes] = {}
        self.store: set[bytes] = set()
        self.running: dict[str, Plan] = {}
        self.next_id = 0
        self.fail_next = False
        self.hits = {tier: 0 for tier in Tier}

    @rule(
        policy=st.sampled_from(list(WritePolicy)),
        device=st.integers(6, 14),
        host=st.integers(0, 8),
        storage=st.booleans(),
    )
    @precondition(lambda self: self.index is None)
    def configure(self, policy, device, host, storage) -> None:
        self.index = CacheIndex(BLOCK, device, host, policy, use_storage=storage)

    @rule(history=st.integers(0, 2), turn=st.integers(0, 3), length=st.integers(0, 9))
    @precondition(lambda self: self.index is not None and len(self.running) < 3)
    def request(self, history, turn, length) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        try:
            plan = self.index.plan(rid, tokens_for(history, turn, length))
        except NoFreeBlocks:
            return
        self.execute(plan)
        self.running[rid] = plan

    def execute(self, plan: Plan) -> None:
        for eviction in plan.evictions:  # in order: they depend on each other
            if isinstance(eviction, SaveHostEviction):  # write-back before the host is reused
                ok = not self._fail()
                if ok:
                    assert self.host[eviction.host_block_id] == eviction.block_hash
                    self.store.add(eviction.block_hash)
                self.index.apply_save_host(eviction.block_hash, ok)
            else:
                self.host[eviction.host_block_id] = self.device[eviction.device_block_id]
        for host, device in plan.swap_ins:
            self.device[device] = self.host[host]
        loaded = 0
        for h, device in plan.loads:  # a load gives a prefix
            if h not in self.store or self._fail():
                break
            self.device[device] = h
            loaded += 1
        self.index.apply_load(plan, loaded)
        for i in plan.compute_blocks:
            self.device[plan.block_table[i]] = plan.hashes[i]
        for i, source in enumerate(plan.sources):
            self.hits[source] += 1
            assert self.device[plan.block_table[i]] == plan.hashes[i], f"block {i} ({source})"

    def _fail(self) -> bool:
        failed, self.fail_next = self.fail_next, False
        return failed

    @rule(data=st.data())
    @precondition(lambda self: self.running)
    def finish(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.running.pop(rid)
        pairs = self.index.finish(rid)
        saved = 0
        for h, device in pairs:
            if self._fail():
                break
            assert self.device[device] == h
            self.store.add(h)
            saved += 1
        self.index.apply_save(pairs, saved)

    @rule()
    def fail_next_operation(self) -> None:
        self.fail_next = True

    @rule(data=st.data())
    @precondition(lambda self: self.store)
    def storage_evicts(self, data) -> None:
        self.store.discard(data.draw(st.sampled_from(sorted(self.store))))

    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        if self.index is not None:
            self.index.check()

    @invariant()
    def running_blocks_are_never_evicted(self) -> None:
        for plan in self.running.values():
            for h, device in zip(plan.hashes, plan.block_table):
                assert self.device[device] == h


TestIndexStateful = Engine.TestCase
TestIndexStateful.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_multi_turn_reuse_across_tiers() -> None:
    index = CacheIndex(BLOCK, num_device_blocks=6, num_host_blocks=4, write_policy="write_back")
    first = index.plan("a", tokens_for(0, 0, 4))  # 5 full blocks, all computed
    assert first.count(Tier.COMPUTE) == 5 and index.finish("a") == []
    again = index.plan("b", tokens_for(0, 1, 4))  # same 4-block prefix, new last block
    assert [s.value for s in again.sources] == ["device"] * 4 + ["compute"]
    assert again.tokens_to_compute == BLOCK
    index.finish("b")
    other = index.plan("c", tokens_for(1, 0, 8))  # needs 6 blocks: evicts to host
    assert [type(e) for e in other.evictions] == [SwapOutEviction] * 4
    assert other.count(Tier.DEVICE) == 2  # the shared system prompt
    index.finish("c")
    back = index.plan("d", tokens_for(0, 0, 4))
    assert back.count(Tier.HOST) == 2 and len(back.swap_ins) == 2
    # Write-back: host blocks reused in this plan are saved first; block 4 then loads from there.
    assert [type(e) for e in back.evictions][:2] == [SaveHostEviction, SwapOutEviction]
    assert back.sources[4] is Tier.STORAGE
    index.check()


def test_bad_policy_and_double_request() -> None:
    with pytest.raises(ConfigError, match="write_policy: got 'write_around'"):
        CacheIndex(BLOCK, 4, 4, "write_around")
    index = CacheIndex(BLOCK, 4, 0)
    index.plan("x", SYSTEM)
    with pytest.raises(InvalidInput, match="already running"):
        index.plan("x", SYSTEM)
    with pytest.raises(NoFreeBlocks):
        index.plan("y", list(range(500, 520)))
    index.check()
