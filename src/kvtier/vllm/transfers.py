"""StepTransfers: one vLLM rank's loads and saves, step by step, as kvtier tasks.

What the worker side does each step, apart from vLLM's set-up (``kvtier.vllm.worker``): submit the
step's loads and saves to this rank's kvtier worker, report which requests finished receiving or
sending, which blocks failed to load (vLLM recomputes exactly those), and count what really
happened. It needs only a ``Client`` and the block size, so it is tested without an engine
(``tests/unit/test_connector.py``).

Loads and saves are asynchronous. A load's answer names the prefix of blocks it filled; the rest are
reported through ``load_errors`` in the same step the request is reported finished receiving. A load
within the step is waited for before the forward, for ``LoadSpec.wait_s`` at most: past that its
store stalls, so its blocks are reported failed (vLLM recomputes them) and the load goes on. It can
only write the request's own blocks, with the KV of the same tokens; the request is reported sent
once it is answered, so its blocks are never freed under it (the scheduler side fences every request
that loaded within a step). Saves never block a step; a finished request is reported sent once every
save of it was answered (its blocks are kept until then). Saves are counted when answered, from the
client's I/O thread: written and already-stored tokens apart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from kvtier.errors import KvtierError
from kvtier.transport import tasks as t
from kvtier.vllm.events import RankEventLog
from kvtier.vllm.metadata import REPORT_WAITING_S, KvtierMetadata, KvtierWorkerMetadata, LoadSpec
from kvtier.vllm.stats import KvtierConnectorStats

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # an idle step waits at most this long for an in-flight load
FENCE_TIMEOUT_S = 120.0  # a preemption or shutdown waits this long for a task's answer
ESTIMATES_TIMEOUT_S = 5.0  # the estimates sent to the kvtier worker (each second) expire then


class StepTransfers:
    def __init__(self, block_size: int, rank: int = 0, wait_for_saves: bool = False) -> None:
        """``wait_for_saves``: a producer's step ends once its saves are stored (its requests
        are answered only then: the consumer's lookup that follows finds every block)."""
        self.block_size, self.rank, self.wait_for_saves = block_size, rank, wait_for_saves
        self.client: Any = None  # set once the kvtier worker answered its hello
        self.stats = KvtierConnectorStats()
        self._stats_lock = threading.Lock()
        self._loads: dict[str, tuple[Future, LoadSpec]] = {}
        self._in_step: dict[str, Future] = {}  # each request's last load within a step
        self._saves: dict[str, list[Future]] = defaultdict(list)
        self._finished: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_hashes: set[bytes] = set()
        self._load_times: list = []  # (blocks per tier, seconds)
        self._unanswered: dict[Future, tuple[int, float]] = {}  # saves: blocks, submitted at
        self._save_times: list[tuple[int, float]] = []  # answered: blocks written, own seconds
        self._in_step_wait_s = 0.0  # the forward's waits for loads within the step, not reported
        self.events: RankEventLog | None = None  # set where kvtier's KV events are published

    # ---- each step --------------------------------------------------------------------------

    def start_load_kv(self, meta: KvtierMetadata) -> None:
        if not meta.loads and not meta.lookup_counts and not meta.estimates:
            return  # most steps: called on vLLM's step path, so nothing is done for nothing
        if self.rank == 0 and meta.lookup_counts:
            self._count(**meta.lookup_counts)  # the scheduler's counts, reported once
        if meta.estimates:
            if self.rank == 0:  # vLLM's stats: once
                with self._stats_lock:
                    self.stats.set_estimates(meta.estimates)
            if self.client is not None:  # this rank's kvtier worker: its exporter shows them
                args: dict[str, t.Scalar] = dict(meta.estimates)
                control = t.Control(method=t.ControlMethod.ESTIMATES.value, args=args)
                self.client.submit(control, ESTIMATES_TIMEOUT_S)  # answered or not: no matter
        sync = []
        for spec in meta.loads:
            task = t.Load(block_hashes=spec.block_hashes, device_block_ids=spec.block_ids)
            future = self._submit(task)
            _time(future)
            if spec.sync:
                sync.append((future, spec))
            else:
                self._loads[spec.req_id] = (future, spec)
        since = _now()  # a wait (``LoadSpec.wait_s``) is the step's, shared by its loads
        for future, spec in sync:  # this step's forward reads these blocks: wait for them
            _wait(future, FENCE_TIMEOUT_S if spec.wait_s is None else since + spec.wait_s - _now())
            self._in_step[spec.req_id] = future
            if future.done():
                self._account_load(future, spec)
            else:
                self._stop_waiting(future, spec)
        if sync:  # the forward waited this long for kvtier: not the engine's step time
            self._in_step_wait_s += _now() - since

    def wait_for_save(self, meta: KvtierMetadata) -> None:
        """Submit this step's saves, every request's in one task; never waits for them (they
        finish off the critical path). Each request is reported sent once that task is."""
        if not meta.saves:
            return
        task = t.Save(
            block_hashes=[h for spec in meta.saves for h in spec.block_hashes],
            device_block_ids=[i for spec in meta.saves for i in spec.block_ids],
        )
        future = self._submit(task)
        with self._stats_lock:  # _account_save, called once it is answered, takes it out
            self._unanswered[future] = (len(task.block_hashes), _now())
        self._count(save_tasks=1)
        hashes = task.block_hashes
        future.add_done_callback(lambda f: self._account_save(f, hashes))  # when answered
        for spec in meta.saves:
            self._saves[spec.req_id].append(future)
        if self.wait_for_saves:
            _wait(future)

    def handle_preemptions(self, meta: KvtierMetadata) -> None:
        """A preempted request's blocks are reused this step: its saves must have read them."""
        for req_id in meta.preempted:
            for future in self._saves.get(req_id, ()):
                _wait(future)
            if req_id in self._in_step:  # kept: the request is reported sent when it finishes
                _wait(self._in_step[req_id])

    def _submit(self, task: Any) -> Future:
        if self.client is None:
            failed: Future = Future()
            failed.set_exception(KvtierError("the kvtier worker is not running"))
            return failed
        return self.client.submit(task)

    # ---- results ----------------------------------------------------------------------------

    def get_finished(
        self, finished_req_ids: set[str], idle: bool = False
    ) -> tuple[set[str], set[str]]:
        """(finished sending, finished receiving) request ids."""
        fenced = self._saves or self._in_step
        if not self._loads and not self._finished and not (finished_req_ids and fenced):
            return set(), set()  # most steps: nothing in flight that a request waits for
        if idle and self._loads:
            # Nothing else to run this step: wait for a load here instead of letting vLLM spin
            # through empty steps (the spin takes the CPU the kvtier worker is loading with).
            futures = [f for f, _ in self._loads.values()]
            wait(futures, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        recving = {req_id for req_id, (f, _) in self._loads.items() if f.done()}
        for req_id in recving:
            future, spec = self._loads.pop(req_id)
            self._account_load(future, spec)
        # Fenced by the scheduler side: those with saves, and those that loaded within a step.
        self._finished |= {r for r in finished_req_ids if r in self._saves or r in self._in_step}
        sending = set()
        for req_id in list(self._finished):
            load = self._in_step.get(req_id)
            if all(f.done() for f in self._saves.get(req_id, ())) and (load is None or load.done()):
                sending.add(req_id)
                self._finished.discard(req_id)
                self._saves.pop(req_id, None)
                self._in_step.pop(req_id, None)
        return sending, recving

    def load_errors(self) -> set[int]:
        """vLLM block ids whose load failed since the last call (vLLM recomputes them)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def worker_meta(self) -> KvtierWorkerMetadata | None:
        """Block hashes that failed to load (the scheduler side saves them again) and the
        transfers' times (its load-or-recompute estimates)."""
        if not (
            self._failed_hashes
            or self._load_times
            or self._save_times
            or self._unanswered
            or self._in_step_wait_s
        ):
            return None  # most steps (read unlocked: news that lands now goes with the next)
        with self._stats_lock:
            loads, self._load_times = self._load_times, []
            saves, self._save_times = self._save_times, []
            unanswered = bool(self._unanswered)
        waiting = []
        # A save unanswered counts only for its time blocked on the store (the kvtier worker's
        # save watch, on its heartbeats): not its queue, nor its thread's waits for a core.
        blocked = self.client.blocked_save() if unanswered and self.client is not None else None
        if blocked is not None and blocked[1] >= REPORT_WAITING_S:
            waiting.append(blocked)
        waited_s, self._in_step_wait_s = self._in_step_wait_s, 0.0
        if not (self._failed_hashes or loads or waiting or saves or waited_s):
            return None
        meta = KvtierWorkerMetadata(self._failed_hashes, loads, waiting, saves, waited_s)
        self._failed_hashes = set()
        return meta

    def take_stats(self) -> KvtierConnectorStats | None:
        if self.stats.is_empty():
            return None  # most steps (read unlocked: counts that land now go with the next)
        with self._stats_lock:
            if self.stats.is_empty():
                return None
            stats, self.stats = self.stats, KvtierConnectorStats()
        return stats

    def drain(self) -> None:
        """Wait for every task in flight (at shutdown)."""
        for future, _ in self._loads.values():
            _wait(future)
        for futures in self._saves.values():
            for future in futures:
                _wait(future)
        for future in self._in_step.values():
            _wait(future)

    # ---- accounting -------------------------------------------------------------------------

    def _account_load(self, future: Future, spec: LoadSpec) -> None:
        try:
            result: t.Result = future.result()
            self._note_events(result)
            loaded = len(result.blocks)
            self._count(
                load_bytes=result.bytes_moved,
                load_microseconds=int(result.seconds * 1e6),
                load_core_wait_microseconds=int(result.cpu_wait_s * 1e6),
            )
            if loaded == len(spec.block_ids):  # a full load: a sample of the store's speed
                self._note_time(future, spec.per_tier())
            for tier, n in enumerate(spec.per_tier(loaded)):  # one backend: tier 0
                if n:
                    self._count(**{f"tier{tier}_loaded_tokens": n * self.block_size})
        except Exception as e:  # lost worker, timeout: every block of it is recomputed
            log.warning("kvtier load for %s failed: %s", spec.req_id, e)
            loaded = 0
        if loaded < len(spec.block_ids):  # failed slowly: its tiers are at least that slow
            self._note_time(future, spec.per_tier(), at_least_s=REPORT_WAITING_S)
        failed = spec.block_ids[loaded:]
        self._load_errors.update(failed)
        self._failed_hashes.update(spec.block_hashes[loaded:])
        bs = self.block_size
        self._count(loaded_tokens=loaded * bs, failed_tokens=len(failed) * bs)

    def _stop_waiting(self, future: Future, spec: LoadSpec) -> None:
        """An in-step load not answered within ``spec.wait_s``: its store stalls. vLLM
        recomputes its blocks; the time so far is a floor of its tiers' load time (so the next
        loads from them go asynchronous or are declined); the load goes on."""
        log.warning(
            "kvtier load for %s within the step: not answered in %.1f s (a stalled store?); "
            "its %d blocks are recomputed, and its request keeps them until it is answered",
            spec.req_id,
            spec.wait_s,
            len(spec.block_ids),
        )
        started, _ = getattr(future, "kvtier_times", (_now(), None))
        with self._stats_lock:
            self._load_times.append((spec.per_tier(), _now() - started))
        self._load_errors.update(spec.block_ids)
        self._failed_hashes.update(spec.block_hashes)
        self._count(failed_tokens=len(spec.block_ids) * self.block_size)

    def _account_save(self, future: Future, hashes: list[bytes]) -> None:
        with self._stats_lock:
            self._unanswered.pop(future, None)
        try:
            result: t.Result = future.result()
            self._note_events(result, hashes[: len(result.blocks)])
            bs = self.block_size
            self._count(
                saved_tokens=(len(result.blocks) - result.count) * bs,
                skipped_tokens=result.count * bs,
                save_bytes=result.bytes_moved,
            )
            if result.status is not t.Status.OK:
                self._count(save_failures=1)
            elif len(result.blocks) > result.count:  # blocks written: a sample of its own time
                # (less its waits for a core: a niced thread on a busy machine, not the store)
                store_s = result.seconds - result.cpu_wait_s
                with self._stats_lock:
                    self._save_times.append((len(result.blocks) - result.count, store_s))
        except Exception:
            self._count(save_failures=1)

    def _note_time(self, future: Future, blocks: tuple[int, ...], at_least_s: float = 0.0) -> None:
        """A load's time from submission to answer, a sample for the scheduler's estimates
        (``at_least_s``: only if it took that long)."""
        started, done = getattr(future, "kvtier_times", (None, None))
        if started is not None and done is None and future.done():
            done = time.monotonic()
        if started is not None and done is not None and done - started >= at_least_s:
            with self._stats_lock:
                self._load_times.append((blocks, done - started))

    def _note_events(self, result: t.Result, stored: list[bytes] | None = None) -> None:
        if self.events is not None:
            self.events.add(stored or [], list(result.removed), result.all_removed)

    def _count(self, **counts: float) -> None:
        with self._stats_lock:
            self.stats.add(**counts)


_now = time.monotonic


def _time(future: Future) -> None:
    """Record on ``future`` when it was submitted and when it was answered (a thread woken
    by the answer may run before the callback that records it: ``_note_time`` then takes the
    time it runs at)."""
    started = time.monotonic()
    future.kvtier_times = (started, None)  # type: ignore[attr-defined]

    def answered(f: Future) -> None:
        f.kvtier_times = (started, time.monotonic())  # type: ignore[attr-defined]

    future.add_done_callback(answered)


def _wait(future: Future, timeout_s: float = FENCE_TIMEOUT_S) -> None:
    try:
        future.result(max(0.0, timeout_s))
    except Exception:  # answered with an error, lost or timed out: the bytes are not read
        pass
