"""What the scheduler side tells the worker sides each step, and what they report back."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.vllm.decide import tier_counts

# A save blocked on its store this long is reported each step (decide's floor under saves, while
# no load is measured): longer than a sound store's write, shorter than a slow store's.
REPORT_WAITING_S = 0.5


@dataclass
class LoadSpec:
    """Load ``block_hashes`` (a stored prefix) into ``block_ids`` for request ``req_id``."""

    req_id: str
    block_hashes: list[bytes]
    block_ids: list[int]
    sync: bool = False  # the step's forward waits for it (no WAITING_FOR_REMOTE_KVS)
    tiers: bytes = b""  # each block's storage tier, as the lookup found them (Result.tiers)
    # An in-step load's longest wait (``load_mode: auto``: ``IN_STEP_WAIT_S``); None: until
    # answered (``task_timeout_s`` at most).
    wait_s: float | None = None

    def per_tier(self, blocks: int | None = None) -> tuple[int, ...]:
        """How many of the first ``blocks`` (default: all) come from each tier."""
        return tier_counts(self.tiers, len(self.block_ids) if blocks is None else blocks)


@dataclass
class SaveSpec:
    """Save ``block_hashes`` from ``block_ids`` (full prompt blocks computed this step)."""

    req_id: str
    block_hashes: list[bytes]
    block_ids: list[int]


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)  # wait for their saves: blocks are freed
    idle: bool = False  # nothing scheduled this step: the worker side may wait for its loads
    # Scheduler-side counts since the last step, reported by rank 0 in its connector stats.
    lookup_counts: dict[str, int] = field(default_factory=dict)
    # The load-or-recompute estimates in force (``LoadOrRecompute.estimates``), now and then:
    # gauges in rank 0's connector stats.
    estimates: dict[str, float] = field(default_factory=dict)


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """Hashes whose load failed (missing, corrupt): the scheduler saves them again. And the
    loads answered since the last step, ``(blocks per tier, seconds from submission)``: the
    scheduler's load-or-recompute estimates (``kvtier.vllm.decide``). ``waiting_saves``:
    ``(blocks, seconds so far)`` of a rank's save still unanswered and blocked on the store
    for ``REPORT_WAITING_S`` or more: a slow store is noticed while its first save is on its
    way.
    ``save_times``: ``(blocks written, the worker's own seconds)`` of saves answered since the
    last step (not their time from submission: saves queue behind each other; nor the time
    their niced thread waited for a core: a busy machine's, not the store's).
    ``in_step_wait_s``: how long the step's forward waited for loads within the step (the
    slowest rank's): kvtier's time, taken out of the engine's step time."""

    failed_hashes: set[bytes] = field(default_factory=set)
    load_times: list[tuple[tuple[int, ...], float]] = field(default_factory=list)
    waiting_saves: list[tuple[int, float]] = field(default_factory=list)
    save_times: list[tuple[int, float]] = field(default_factory=list)
    in_step_wait_s: float = 0.0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvtierWorkerMetadata):
            return KvtierWorkerMetadata(
                self.failed_hashes | other.failed_hashes,
                self.load_times + other.load_times,
                self.waiting_saves + other.waiting_saves,
                self.save_times + other.save_times,
                max(self.in_step_wait_s, other.in_step_wait_s),
            )
        return self
