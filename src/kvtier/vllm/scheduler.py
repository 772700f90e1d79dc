"""The scheduler side: which prefixes kvtier holds, what to load, what to save, when to free.

- Lookup: ``get_num_new_matched_tokens`` asks every rank's kvtier worker how many leading blocks
  of the prompt it holds (a ``Lookup`` task: the workers build the keys — namespace, weight
  version, fingerprint, rank — so there is no second copy of that logic here) and offers the
  shortest prefix over ranks, block-aligned, never the prompt's last token.
- Loads run within the step that schedules the request (the forward waits for them) or
  asynchronously (the request waits in WAITING_FOR_REMOTE_KVS while other requests run):
  ``load_mode`` ``sync`` / ``async``, or ``auto`` (default) deciding per request — within the
  step when the load is estimated shorter than a step (``kvtier.vllm.decide``).
- One lookup per request: vLLM asks again on every scheduling attempt while a request waits
  (no free blocks, the token budget spent); the answer is kept and reused — shortened when
  vLLM's own cache now covers more of the prompt — until the request is allocated, finishes,
  a load fails, vLLM resets the connector's cache (``reset_cache``: after a weight update) or
  ``LOOKUP_REUSE_S`` passes.
- Load or recompute (``kvtier.vllm.decide``): a hit whose load is estimated slower than its
  recompute, from measured rates, is declined (``load_or_recompute``; ``declined_tokens``);
  while any hit would be, requests are not looked up at all (``lookups_skipped``).
- Deduplication: while a load of some blocks is in flight, a request that needs the same blocks
  waits (``None``) and then hits them in vLLM's own prefix cache, so each object is loaded once;
  a block hash submitted for saving is not submitted again.
- Saves: every full prompt block — and, with ``save_generated`` (default), every full block of
  generated tokens, so a chat's next turn hits its previous answer — once the step that
  computes it has run (chunked prefill included), is saved asynchronously by the worker sides
  (``wait_for_save``: one task per step), never on the critical path. Blocks whose load would
  be declined are not saved (``unsaved_tokens``; ``kvtier.vllm.decide``).
- Fences: a request whose load or saves are still in flight keeps its blocks after it finishes
  (``request_finished`` returns True) until the workers report the transfer done; a preempted
  request's saves are waited for before its blocks are reused (``handle_preemptions``).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.engine.client import Client
from kvtier.errors import KvtierError
from kvtier.vllm.decide import IN_STEP_WAIT_S, LoadOrRecompute
from kvtier.vllm.metadata import KvtierMetadata, KvtierWorkerMetadata, LoadSpec, SaveSpec
from kvtier.worker.config import endpoint_for

log = logging.getLogger(__name__)

MAX_REMEMBERED_HASHES = 1 << 20  # hashes known saved: a bounded LRU (~32 MiB at most)
LOOKUP_TIMEOUT_S = 10.0
# A kept lookup answer is this old at most: objects evicted meanwhile cost a failed load (a
# recompute), never a wrong token, so the bound is about wasted work, not correctness.
LOOKUP_REUSE_S = 5.0
ESTIMATES_EVERY_S = 1.0  # the decision's estimates go to vLLM's stats (gauges) this often
DECLINE_LOG_EVERY_S = 10.0  # one log line per declined load at most this often (the rest counted)


@dataclass
class _Lookup:
    first: int  # the first block looked up
    last: int  # one past the last
    count: int  # leading blocks stored
    worth: int  # of those, how many to load (load or recompute)
    tiers: bytes  # the tier of each stored block (Result.tiers)
    at: float  # time.monotonic() of the answer
    in_step: bool = False  # loaded within the step that schedules it (load_mode)

    def reuse(self, first: int, last: int, now: float) -> tuple[int, int, bytes] | None:
        """(stored, to load, their tiers) for blocks ``first:last``, if this answer still
        gives them."""
        if last != self.last or first < self.first or now - self.at > LOOKUP_REUSE_S:
            return None
        skip = first - self.first
        return max(0, self.count - skip), max(0, self.worth - skip), self.tiers[skip:]


@dataclass
class _Tracked:
    request: Any
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0  # leading full prompt blocks already submitted for saving
    has_saves: bool = False
    loaded_in_step: bool = False  # fenced when it finishes: an in-step load may outlive its step


class SchedulerSide:
    def __init__(
        self,
        instance: str,
        world_size: int,
        block_size: int,
        settings: Any,
        endpoints: Sequence[str] | None = None,
        role: str = "kv_both",
    ) -> None:
        """``endpoints``: the ranks' workers (default: the launched workers' ipc:// sockets);
        ``role``: vLLM's ``kv_role`` (a producer never looks up, a consumer never saves)."""
        self.block_size = block_size
        self.looks_up = role != "kv_producer"
        self.saves = role != "kv_consumer"
        self.settings = settings
        self.load_mode = settings.load_mode
        if endpoints is None:
            endpoints = [endpoint_for(instance, rank) for rank in range(world_size)]
        self.client: Client | None = Client.connect(
            endpoints,
            start_timeout_s=settings.start_timeout_s,
            task_timeout_s=settings.task_timeout_s,
        )
        self._tracked: dict[str, _Tracked] = {}
        # first, count, requested, tiers of the blocks to load; within the step?
        self._pending_load: dict[str, tuple[int, int, int, bytes, bool]] = {}
        self._lookups: dict[str, _Lookup] = {}  # kept answers of requests still waiting
        self._loads_out: list[LoadSpec] = []
        self._loading: dict[str, tuple[list[bytes], bool]] = {}  # hashes; within the step?
        self._loading_hashes: Counter[bytes] = Counter()
        self._submitted: OrderedDict[bytes, None] = OrderedDict()
        self._counts: Counter[str] = Counter()
        self._sync_loaded: list[LoadSpec] = []
        self._broken = False
        self.decide = LoadOrRecompute(block_size, settings.load_or_recompute)
        self._estimates_at = float("-inf")
        self._decline_log = _DeclineLog()
        # The store's tiers, as the workers were launched with them (the default: one).
        backends = settings.storage_config.backends
        self.tier_count = len(backends)
        self.tier_names = [b.backend for b in backends]

    # ---- lookup -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed: int
    ) -> tuple[int | None, bool]:
        bs = self.block_size
        first = num_computed // bs
        last = (request.num_tokens - 1) // bs  # the last prompt token is always computed
        wanted = list(request.block_hashes[first:last])
        if not wanted or self.client is None or not self.looks_up:
            return 0, False
        if any(h in self._loading_hashes for h in wanted):
            return None, False  # being loaded for another request: wait, then hit it locally
        now = time.monotonic()
        kept = self._lookups.get(request.request_id)
        answer = kept.reuse(first, last, now) if kept is not None else None
        if answer is None and not self.decide.worth_looking_up(len(wanted), self.tier_count):
            # Any answer would be declined (a slow store): vLLM's loop does not wait for one.
            self._pending_load.pop(request.request_id, None)
            self._counts.update(lookups=1, lookups_skipped=1, requested_tokens=len(wanted) * bs)
            return 0, False
        if answer is None:  # vLLM asks again while the request waits: decided once
            stored, tiers = self._lookup(wanted)
            waited_s = time.monotonic() - now  # vLLM's scheduling loop waited
            waited_us = int(waited_s * 1e6)
            self.decide.waited(waited_s, lookup=True)
            worth = self.decide.blocks_to_load(stored, tiers)
            kept = _Lookup(first, last, stored, worth, tiers, now, self._in_step(worth, tiers))
            self._lookups[request.request_id] = kept
            self._counts.update(lookup_round_trips=1, lookup_microseconds=waited_us)
            if worth < stored:
                self._counts.update(declined_tokens=(stored - worth) * bs)
                self._decline_log.note(self.decide, stored, tiers, self.tier_names)
            for h in wanted[stored:]:  # not stored (any more): a save may store it again
                self._submitted.pop(h, None)
        else:
            stored, worth, tiers = answer
        if worth == 0:
            self._pending_load.pop(request.request_id, None)
            self._counts.update(lookups=1, requested_tokens=len(wanted) * bs)
            return 0, False
        in_step = kept is not None and kept.in_step
        self._pending_load[request.request_id] = (first, worth, len(wanted), tiers[:worth], in_step)
        return worth * bs, not in_step

    def _in_step(self, blocks: int, tiers: bytes) -> bool:
        """Load ``blocks`` within the step that schedules them (``load_mode``)?"""
        if self.load_mode == "auto":
            return self.decide.load_in_step(blocks, tiers)
        return self.load_mode == "sync"

    def may_load_async(self, request: Any) -> bool:
        """Did this waiting request's kept lookup find stored blocks, loaded asynchronously?
        A dictionary look-up: vLLM asks whenever the request enters a waiting queue."""
        kept = self._lookups.get(request.request_id)
        return kept is not None and kept.worth > 0 and not kept.in_step

    def _lookup(self, hashes: list[bytes]) -> tuple[int, bytes]:
        try:
            assert self.client is not None
            return self.client.lookup_tiers(hashes, timeout_s=LOOKUP_TIMEOUT_S)
        except KvtierError as e:  # a miss, never a failed request
            if not self._broken:
                log.error("kvtier lookup failed (%s): serving without kvtier hits", e)
                self._broken = True
            return 0, b""

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request))
        tracked.request = request
        tracked.block_ids = list(blocks.get_block_ids()[0])
        self._lookups.pop(request.request_id, None)  # scheduled: a later ask is a new question
        pending = self._pending_load.pop(request.request_id, None)
        if pending is None:
            return
        first, count, requested, tiers, in_step = pending
        self._counts.update(
            lookups=1, requested_tokens=requested * self.block_size, found_tokens=num_external
        )
        n = num_external // self.block_size
        if n <= 0:
            return
        hashes = list(request.block_hashes[first : first + n])
        ids = tracked.block_ids[first : first + n]
        wait_s = IN_STEP_WAIT_S if in_step and self.load_mode == "auto" else None
        spec = LoadSpec(request.request_id, hashes, ids, in_step, tiers[:n], wait_s)
        self._loads_out.append(spec)
        tracked.loaded_in_step |= in_step
        self._loading[request.request_id] = (hashes, in_step)
        self._loading_hashes.update(hashes)
        if in_step:
            self._counts.update(in_step_loaded_tokens=n * self.block_size)

    # ---- each step --------------------------------------------------------------------------

    def build_connector_meta(self, so: Any) -> KvtierMetadata:
        self.decide.step(so.total_num_scheduled_tokens)
        for spec in self._sync_loaded:  # loaded during the previous step's forward
            self._finish_loading(spec.req_id)
        self._sync_loaded = [s for s in self._loads_out if s.sync]
        meta = KvtierMetadata(
            loads=self._loads_out,
            preempted=set(so.preempted_req_ids or ()),
            lookup_counts=dict(self._counts),
            idle=so.total_num_scheduled_tokens == 0,
        )
        now = time.monotonic()
        if now - self._estimates_at >= ESTIMATES_EVERY_S:
            self._estimates_at = now
            meta.estimates = self.decide.estimates()
        self._loads_out, self._counts = [], Counter()
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                computed[new.req_id] = new.num_computed_tokens
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tracked.block_ids.extend(new_ids[0])
            computed[req_id] = cached.num_computed_tokens[i]
        for req_id, done in computed.items():
            save = self._save_for(req_id, done + so.num_scheduled_tokens.get(req_id, 0))
            if save is not None:
                meta.saves.append(save)
        return meta

    def _save_for(self, req_id: str, tokens_done: int) -> SaveSpec | None:
        """The full blocks this step completes that nobody saved yet: the prompt's, and with
        ``save_generated`` the generated tokens' too."""
        tracked = self._tracked[req_id]
        request = tracked.request
        if not self.saves:
            return None
        if not self.settings.save_generated:
            tokens_done = min(tokens_done, request.num_prompt_tokens)
        full = tokens_done // self.block_size
        full = min(full, len(request.block_hashes), len(tracked.block_ids))
        if full <= tracked.saved_blocks:
            return None
        start = tracked.saved_blocks
        tracked.saved_blocks = full
        hashes = list(request.block_hashes[start:full])
        # A chain: once a hash was submitted, so was its whole prefix. Submit the rest.
        skip = 0
        while skip < len(hashes) and hashes[skip] in self._submitted:
            skip += 1
        if skip == len(hashes):
            return None
        if not self.decide.worth_saving(full):  # its load would be declined: not worth a fence
            self._counts.update(unsaved_tokens=(len(hashes) - skip) * self.block_size)
            return None
        for h in hashes[skip:]:
            self._remember(h)
        tracked.has_saves = True
        return SaveSpec(req_id, hashes[skip:], tracked.block_ids[start + skip : full])

    def _remember(self, block_hash: bytes) -> None:
        self._submitted[block_hash] = None
        self._submitted.move_to_end(block_hash)
        if len(self._submitted) > MAX_REMEMBERED_HASHES:
            self._submitted.popitem(last=False)

    # ---- results ----------------------------------------------------------------------------

    def update_connector_output(self, output: Any) -> None:
        for req_id in output.finished_recving or ():
            self._finish_loading(req_id)
        meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(meta, KvtierWorkerMetadata):
            for per_tier, seconds in meta.load_times:
                self.decide.loaded(per_tier, seconds)
            for n, seconds in meta.waiting_saves:
                self.decide.waiting(n, seconds)
            for n, seconds in meta.save_times:
                self.decide.saved(n, seconds)
            self.decide.waited(meta.in_step_wait_s)  # the forward waited for kvtier
            for h in meta.failed_hashes:  # gone from storage: save it again when computed
                self._submitted.pop(h, None)
            if meta.failed_hashes:
                self._lookups.clear()  # kept answers may name them too
                self._save_again_after(meta.failed_hashes)

    def _save_again_after(self, failed: set[bytes]) -> None:
        """A load within the step failed: vLLM recomputes those blocks in a later step, whose
        saves would start past them (the request was scheduled with them computed, and its
        saves moved on). Its saves start at the first failed block again."""
        for req_id, (_, in_step) in self._loading.items():
            tracked = self._tracked.get(req_id)
            if not in_step or tracked is None:
                continue
            known = tracked.request.block_hashes[: tracked.saved_blocks]
            bad = next((i for i, h in enumerate(known) if h in failed), None)
            if bad is not None:
                tracked.saved_blocks = bad

    def _finish_loading(self, req_id: str) -> None:
        hashes, _ = self._loading.pop(req_id, ([], False))
        for h in hashes:
            self._loading_hashes[h] -= 1
            if self._loading_hashes[h] <= 0:
                del self._loading_hashes[h]

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks while a load or a save of this request is in flight."""
        tracked = self._tracked.pop(request.request_id, None)
        self._pending_load.pop(request.request_id, None)
        self._lookups.pop(request.request_id, None)
        load = self._loading.get(request.request_id)
        loading = load is not None and not load[1]
        # A load within the step that its step stopped waiting for may still be running: its
        # worker sides report the request sent once it is answered (``StepTransfers``).
        saving = tracked is not None and (tracked.has_saves or tracked.loaded_in_step)
        return loading or saving, None

    def reset_cache(self) -> bool:
        """vLLM resets caches (after a weight update): forget kept lookups and saved hashes,
        so nothing is skipped or promised on the strength of what the old weights stored."""
        self._lookups.clear()
        self._submitted.clear()
        return True

    def close(self) -> None:
        if self.client is not None:
            self.client.close()  # connected, not launched: the workers keep running
            self.client = None


class _DeclineLog:
    """One INFO line per declined load, at most one per ``DECLINE_LOG_EVERY_S`` (the ones
    between are counted in the next): which tiers, how many blocks, the estimated load against
    the recompute, and the estimates behind them (``LoadOrRecompute.explain``)."""

    def __init__(self) -> None:
        self._at = float("-inf")
        self._quiet = 0

    def note(self, decide: LoadOrRecompute, found: int, tiers: bytes, names: list[str]) -> None:
        now = time.monotonic()
        if now - self._at < DECLINE_LOG_EVERY_S:
            self._quiet += 1
            return
        self._at, quiet, self._quiet = now, self._quiet, 0
        v = decide.explain(found, tiers)
        where = ", ".join(
            f"{n} from tier {i} ({names[i] if i < len(names) else '?'})"
            for i, n in enumerate(v.tiers)
            if n
        )
        load = "unknown" if v.load_s is None else f"{v.load_s * 1e3:.1f} ms"
        log.info(
            "kvtier declined %d of %d stored blocks (%s): load estimated %s, recompute %.1f ms "
            "(loads under %.1f ms, one engine step, are always taken); estimates %s%s",
            found - v.loaded,
            found,
            where,
            load,
            v.recompute_s * 1e3,
            v.always_take_s * 1e3,
            {k: round(x, 6) for k, x in decide.estimates().items()},
            f"; {quiet} more declined since the last line" if quiet else "",
        )
