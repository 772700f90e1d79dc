"""CacheIndex: the engine-side bookkeeping of which block lives where (no I/O, no threads).

For every known block (by chained hash) the index records its device block, its host block and
whether storage holds it. A new request gets a ``Plan``: the leading blocks it can reuse from
each tier, the tasks that bring them to the device (``swap_in`` from host, ``load`` from
storage), the evictions that make room first (``save_host`` for write-back, ``swap_out``),
and the blocks left to compute. The engine runs the evictions in order, then the swap-ins and
loads, reports results back (``apply_load``, ``apply_save``...), computes the rest, and calls
``finish`` when the request ends.

Policies: device and host blocks are reused least-recently-used first among blocks no running
request holds (a reference count protects the others). An evicted device block goes to host
unless host has it, or storage has it and host has no free block; an evicted host block is
saved to storage first under ``write_back`` (``write_through`` saves every block when its
request finishes instead).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvtier.errors import ConfigError, InvalidInput, NoFreeBlocks
from kvtier.layout.keys import block_hashes


class WritePolicy(str, Enum):
    WRITE_THROUGH = "write_through"
    WRITE_BACK = "write_back"


class Tier(str, Enum):
    DEVICE = "device"
    HOST = "host"
    STORAGE = "storage"
    COMPUTE = "compute"


@dataclass
class BlockState:
    hash: bytes
    device: int | None = None
    host: int | None = None
    stored: bool = False
    refs: int = 0  # running requests using its device block


class _Pool:
    """Block ids of one tier: free ones, and cached ones in LRU order (oldest first)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[int, bytes] = OrderedDict()  # unreferenced, holding a block

    def touch(self, block_id: int, block_hash: bytes) -> None:
        self.cached.pop(block_id, None)
        self.cached[block_id] = block_hash


@dataclass(frozen=True)
class SwapOutEviction:
    """Move a device block to a host block before the device block is reused."""

    device_block_id: int
    host_block_id: int


@dataclass(frozen=True)
class SaveHostEviction:
    """Write a host block back to storage (write-back) before the host block is reused."""

    block_hash: bytes
    host_block_id: int


Eviction = SwapOutEviction | SaveHostEviction


@dataclass
class Plan:
    """What the engine does for one request, in this order."""

    request_id: str
    hashes: list[bytes]
    num_tokens: int
    block_size: int
    block_table: list[int]  # device block of every full block of the request
    sources: list[Tier]  # where each full block comes from
    # Evictions, in the order they must run (a later one may reuse a block an earlier one freed).
    evictions: list[Eviction] = field(default_factory=list)
    swap_ins: list[tuple[int, int]] = field(default_factory=list)  # (host, device)
    loads: list[tuple[bytes, int]] = field(default_factory=list)  # (hash, device), in order

    def count(self, tier: Tier) -> int:
        return sum(1 for s in self.sources if s is tier)

    @property
    def tokens_to_compute(self) -> int:
        """Tokens the engine must compute: the blocks not reused, and the partial tail."""
        reused = len(self.sources) - self.count(Tier.COMPUTE)
        return self.num_tokens - reused * self.block_size

    @property
    def compute_blocks(self) -> list[int]:
        """Indexes (in the request) of the full blocks to compute."""
        return [i for i, s in enumerate(self.sources) if s is Tier.COMPUTE]


class CacheIndex:
    def __init__(
        self,
        block_size: int,
        num_device_blocks: int,
        num_host_blocks: int,
        write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH,
        use_storage: bool = True,
        use_host: bool = True,
    ) -> None:
        try:
            self.write_policy = WritePolicy(write_policy)
        except ValueError:
            raise ConfigError(
                "write_policy", f"got {write_policy!r}; allowed: write_through, write_back"
            ) from None
        self.block_size = block_size
        self.use_storage = use_storage
        self.use_host = use_host and num_host_blocks > 0
        self.device = _Pool(num_device_blocks)
        self.host = _Pool(num_host_blocks)
        self.blocks: dict[bytes, BlockState] = {}
        self.requests: dict[str, Plan] = {}

    # ---- a new request ----------------------------------------------------------------------

    def plan(self, request_id: str, token_ids: Sequence[int]) -> Plan:
        """Match the longest cached prefix across tiers and reserve device blocks for all."""
        if request_id in self.requests:
            raise InvalidInput(f"request {request_id!r} is already running")
        hashes = block_hashes(list(token_ids), self.block_size)
        self._check_room(request_id, hashes)  # before anything changes: a plan never half-fails
        plan = Plan(request_id, hashes, len(token_ids), self.block_size, [], [])
        reusable = True  # a prefix: after the first block to compute, everything is computed
        for h in hashes:
            state = self.blocks.setdefault(h, BlockState(h))
            if state.device is not None:  # on device: hold it (its bytes are already right)
                self._hold(state)
                plan.block_table.append(state.device)
                plan.sources.append(Tier.DEVICE if reusable else Tier.COMPUTE)
                continue
            if reusable and state.host is not None:
                source = Tier.HOST
                self.host.cached.pop(state.host, None)  # pinned until finish
            elif reusable and state.stored and self.use_storage:
                source = Tier.STORAGE
            else:
                reusable, source = False, Tier.COMPUTE
            state.refs += 1  # held first: evictions below must not forget this block
            device = self._allocate_device(plan)
            assert device is not None, "_check_room guaranteed a device block"
            state.device = device
            plan.block_table.append(device)
            plan.sources.append(source)
            if source is Tier.HOST and state.host is not None:
                plan.swap_ins.append((state.host, device))
            elif source is Tier.STORAGE:
                plan.loads.append((h, device))
        self.requests[request_id] = plan
        return plan

    def _check_room(self, request_id: str, hashes: list[bytes]) -> None:
        on_device = {
            s.device
            for h in hashes
            if (s := self.blocks.get(h)) is not None and s.device is not None
        }
        needed = len(hashes) - len(on_device)
        available = len(self.device.free) + sum(1 for d in self.device.cached if d not in on_device)
        if needed > available:
            raise NoFreeBlocks(
                f"request {request_id}: needs {needed} more device blocks, "
                f"{available} can be freed (the rest are held by running requests)"
            )

    def _hold(self, state: BlockState) -> None:
        if state.refs == 0 and state.device is not None:
            self.device.cached.pop(state.device, None)
        state.refs += 1

    def _allocate_device(self, plan: Plan) -> int | None:
        if self.device.free:
            return self.device.free.popleft()
        if not self.device.cached:
            return None
        device, victim_hash = self.device.cached.popitem(last=False)
        victim = self.blocks[victim_hash]
        victim.device = None
        # Keep a host copy unless storage has it already and host has no free block left.
        if victim.host is None and self.use_host and (not victim.stored or self.host.free):
            host = self._allocate_host(plan)
            if host is not None:  # swap the victim out to host before its block is reused
                victim.host = host
                self.host.touch(host, victim_hash)
                plan.evictions.append(SwapOutEviction(device, host))
        self._forget_if_nowhere(victim)
        return device

    def _allocate_host(self, plan: Plan) -> int | None:
        if self.host.free:
            return self.host.free.popleft()
        if not self.host.cached:
            return None
        host, victim_hash = self.host.cached.popitem(last=False)
        victim = self.blocks[victim_hash]
        victim.host = None
        if self.write_policy is WritePolicy.WRITE_BACK and self.use_storage and not victim.stored:
            plan.evictions.append(SaveHostEviction(victim_hash, host))  # before the host is reused
            victim.stored = True  # optimistic; apply_save_host(ok=False) takes it back
        self._forget_if_nowhere(victim)
        return host

    def _forget_if_nowhere(self, state: BlockState) -> None:
        if state.device is None and state.host is None and not state.stored and state.refs == 0:
            self.blocks.pop(state.hash, None)

    # ---- results ----------------------------------------------------------------------------

    def apply_swap_in(self, plan: Plan, ok: bool) -> None:
        """A failed swap_in turns those blocks (and all after them) into compute."""
        if not ok:
            self._cut(plan, Tier.HOST)

    def apply_load(self, plan: Plan, loaded: int) -> None:
        """``loaded``: how many of ``plan.loads`` (a prefix) now hold correct data."""
        for h, _ in plan.loads[loaded:]:
            self.blocks[h].stored = False  # evicted or corrupt: storage no longer has it
        if loaded < len(plan.loads):
            first_failed = plan.block_table.index(plan.loads[loaded][1])
            self._cut_from(plan, first_failed)

    def _cut(self, plan: Plan, tier: Tier) -> None:
        if tier in plan.sources:
            self._cut_from(plan, plan.sources.index(tier))

    def _cut_from(self, plan: Plan, index: int) -> None:
        """Blocks from ``index`` on are computed (their device blocks stay reserved)."""
        for i in range(index, len(plan.sources)):
            plan.sources[i] = Tier.COMPUTE

    def apply_save_host(self, block_hash: bytes, ok: bool) -> None:
        state = self.blocks.get(block_hash)
        if state is not None and not ok:
            state.stored = False
            self._forget_if_nowhere(state)

    def finish(self, request_id: str) -> list[tuple[bytes, int]]:
        """The request is done: its blocks become reusable. Returns the (hash, device block)
        pairs to save now (write_through), in order; report them with ``apply_save``."""
        plan = self.requests.pop(request_id)
        to_save = []
        for h, device, source in zip(plan.hashes, plan.block_table, plan.sources):
            state = self.blocks[h]
            state.refs -= 1
            if state.refs == 0:
                self.device.touch(device, h)
            if source is Tier.HOST and state.host is not None:
                self.host.touch(state.host, h)  # unpinned, and now the most recent
            if (
                self.use_storage
                and self.write_policy is WritePolicy.WRITE_THROUGH
                and not state.stored
            ):
                to_save.append((h, device))
        return to_save

    def apply_save(self, pairs: Sequence[tuple[bytes, int]], saved: int) -> None:
        """``saved``: how many of ``pairs`` (a prefix) are now in storage."""
        for h, _ in pairs[:saved]:
            if h in self.blocks:
                self.blocks[h].stored = True

    # ---- checks -----------------------------------------------------------------------------

    def check(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by the tests)."""
        for pool, attr in ((self.device, "device"), (self.host, "host")):
            held = [getattr(s, attr) for s in self.blocks.values() if getattr(s, attr) is not None]
            assert len(held) == len(set(held)), f"one {attr} block holds two blocks"
            assert not set(pool.free) & set(held), f"a {attr} block is both free and used"
            owner = {
                getattr(s, attr): s.hash
                for s in self.blocks.values()
                if getattr(s, attr) is not None
            }
            for block_id, h in pool.cached.items():
                assert owner.get(block_id) == h, f"{attr} block {block_id} cached for another"
            assert len(pool.free) + len(held) <= pool.num_blocks
            assert len(set(pool.free)) == len(pool.free)
        for state in self.blocks.values():
            if state.refs:
                assert state.device is not None, "a referenced block lost its device block"
                assert state.device not in self.device.cached, "a referenced block is evictable"
            assert state.refs >= 0
