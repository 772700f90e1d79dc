"""kvtier's storage as a secondary tier of vLLM's own offloading (``TieringOffloadingSpec``).

vLLM loads it by configuration only (``kv_connector: OffloadingConnector``)::

    "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8000000000,
        "secondary_tiers": [{"type": "KvtierTier", "module_path": "kvtier.vllm.tier",
                             "storage": {"backend": "file", "root": "/data/kv"},
                             "model_dir": "/models/llama", "enable_kv_events": true}]}

The tier sees vLLM's CPU tier as a memoryview of chunk rows (every worker's bytes of a chunk in
one row) and moves whole rows between it and kvtier's store (``kvtier.hosted``): keys carry the
model, the weight version (``weight_version``, or ``model_dir``'s ``version.yaml``, read again
when it changes) and a layout that names the row's size, dtype and the engine's parallel
geometry (another geometry never reads these rows); every load is checked (checksum or MAC,
layout, key), and a bad object is a miss. Lookups run on vLLM's ``AsyncLookupManager`` thread
(the scheduler never waits on storage); stores and loads are handed straight to a store that
moves bytes on threads of its own (the file store: ``StartsTransfers``), else run on this tier's
threads (``workers``, default 4). With ``enable_kv_events`` (and vLLM's KV events on) it
reports what it stored and what kvtier's tiers evicted as vLLM's ``OffloadingEvent``.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    ScheduleEndContext,
    SecondaryTierManager,
    TransferJob,
)

from kvtier.errors import ConfigError
from kvtier.hosted.settings import HostedSettings
from kvtier.hosted.shelf import Shelf, bytes_spec

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger(__name__)

FIELD = "secondary_tiers[KvtierTier]"
MAX_WORKERS = 64


def row_layout(spec: OffloadingSpec, row_bytes: int) -> str:
    """The layout name of a chunk row: what changes its bytes or who may read them."""
    config = spec.config
    parallel = config.parallel
    described = {
        "row_bytes": row_bytes,
        "dtype": str(config.model.dtype),
        "groups": [[g.tokens_per_block, len(g.layer_names)] for g in config.groups],
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "parallel": [parallel.tp_size, parallel.pp_size, parallel.pcp_size, parallel.dcp_size],
        "canonical": config.kv_cache_layout if config.canonical_layout else None,
    }
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
    return f"vllm-tier-{digest[:16]}"


class _Lookups(AsyncLookupManager):
    def __init__(self, tier: KvtierTier) -> None:
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._stored(keys)


class KvtierTier(SecondaryTierManager):
    """A vLLM secondary tier over kvtier's storage (module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        workers: int = 4,
        enable_kv_events: bool = False,
        locality: str | None = None,
        **settings: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if isinstance(workers, bool) or not isinstance(workers, int):
            raise ConfigError(f"{FIELD}.workers", f"must be an integer, got {workers!r}")
        if not 1 <= workers <= MAX_WORKERS:
            raise ConfigError(f"{FIELD}.workers", f"must be 1..{MAX_WORKERS}")
        parsed = HostedSettings.parse(settings, FIELD)
        if not parsed.namespace:
            model = offloading_spec.config.model.name
            parsed = HostedSettings(parsed.storage, model, parsed.weight_version, parsed.model_dir)
        self.locality = Locality(locality) if locality is not None else None
        self._events: list[OffloadingEvent] | None = None
        if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events:
            self._events = []
        row = self.block_size_bytes
        # One flat view of the CPU tier's rows, released at shutdown (vLLM's region cannot
        # unmap while a view of it is exported).
        self._flat: memoryview | None = primary_kv_view.cast("B")
        flat = torch.frombuffer(self._flat, dtype=torch.uint8)
        # Each chunk row as a tensor, made once (a slice per row and job costs microseconds).
        self._row_views: list[torch.Tensor] | None = list(flat.view(-1, row).unbind(0))
        self._shelf = Shelf(parsed, bytes_spec(row, row_layout(offloading_spec, row))).open()
        self._shelf.backend.watch_removals(self._on_removed)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvtier-tier")
        self._jobs = 0  # submitted and not yet answered
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._lock = threading.Lock()  # _jobs, _keys_stored, _removed
        self._drained = threading.Condition(self._lock)  # _jobs fell to 0
        self._keys_stored: dict[str, OffloadKey] = {}  # storage key -> vLLM's, for events
        self._removed: list[OffloadKey] = []
        self._lookups = _Lookups(self)

    # ---- the scheduler's calls (light, never waiting on storage) -------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(self._store, self._start_store, job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(self._load, self._start_load, job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        done = []
        while True:
            try:
                done.append(self._finished.get_nowait())
            except queue.Empty:
                return done

    def has_pending_work(self) -> bool:
        return self._jobs > 0

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return ()
        with self._lock:
            events, self._events = self._events, []
            removed, self._removed = self._removed, []
        if removed:
            events.append(OffloadingEvent(removed, self.medium, True, self.locality))
        return events

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    def drain_jobs(self) -> None:
        with self._drained:
            self._drained.wait_for(lambda: not self._jobs)

    def shutdown(self) -> None:
        self._lookups.shutdown()
        self._pool.shutdown(wait=True)
        self._shelf.close()
        self._row_views = None
        if self._flat is not None:
            self._flat.release()
            self._flat = None

    def stats(self) -> dict[str, Any]:
        """kvtier's counters for this tier (hits, misses, corrupt, evictions, bytes)."""
        return self._shelf.stats()

    # ---- jobs (this tier's threads) ----------------------------------------------------------

    def _submit(self, run: Any, start: Any, job: TransferJob) -> None:
        """``start(job)`` here where the store moves bytes on threads of its own (it only hands
        the job on: one hand-off fewer), else ``run(job)`` on this tier's threads."""
        if len(job.keys) != len(job.chunk_ids):
            raise ValueError(f"{len(job.keys)} keys but {len(job.chunk_ids)} chunk ids")
        started = self._shelf.starts_transfers  # before the count: it raises once shut down
        with self._lock:
            self._jobs += 1
        if started:
            start(job)
            return
        try:
            self._pool.submit(self._run, run, job)
        except RuntimeError:  # shut down
            self._end_job()
            raise

    def _run(self, run: Any, job: TransferJob) -> None:
        try:
            run(job)
        finally:
            self._end_job()

    def _end_job(self) -> None:
        """A job answered (its result queued): ``drain_jobs`` returns once none is left."""
        with self._lock:
            self._jobs -= 1
            if not self._jobs:
                self._drained.notify_all()

    def _blocks(self, chunk_ids: Any) -> list[torch.Tensor]:
        rows = self._row_views
        if rows is None:
            raise RuntimeError("the tier is shut down")
        return [rows[int(c)] for c in chunk_ids]

    def _buffers(self, chunk_ids: Any) -> list[memoryview]:
        """Chunk rows as byte buffers, for the store's started transfers (a slice costs less
        than the tensor's checks and conversions in the store)."""
        flat, row = self._flat, self.block_size_bytes
        if flat is None:
            raise RuntimeError("the tier is shut down")
        return [flat[int(c) * row : (int(c) + 1) * row] for c in chunk_ids]

    def _stored(self, keys: list[OffloadKey]) -> list[bool]:
        try:
            return self._shelf.lookup_each(self._shelf.keys(list(keys)))
        except Exception as e:  # a store that cannot answer: misses
            log.warning("kvtier tier lookup of %d keys failed: %s", len(keys), e)
            return [False] * len(keys)

    def _store(self, job: TransferJob) -> None:
        start, storage_keys, stored = time.monotonic(), [], None
        try:
            # A put keeps an object already stored (kvtier's put contract): no lookup first.
            storage_keys = self._shelf.keys(list(job.keys))
            stored = self._shelf.put(storage_keys, self._blocks(job.chunk_ids))
        except Exception as e:  # answered as a failed job; the cause is logged
            log.warning("kvtier tier store job %d failed: %s", job.job_id, e)
        self._put_done(job, start, stored, storage_keys)

    def _load(self, job: TransferJob) -> None:
        start = time.monotonic()
        found = None
        try:
            found = self._shelf.get(self._shelf.keys(list(job.keys)), self._blocks(job.chunk_ids))
        except Exception as e:  # answered as a failed load
            log.warning("kvtier tier load job %d failed: %s", job.job_id, e)
        self._loaded(job, start, found)

    def _start_store(self, job: TransferJob) -> None:
        self._start(job, "store", self._shelf.start_put, functools.partial(self._put_done, job))

    def _start_load(self, job: TransferJob) -> None:
        self._start(job, "load", self._shelf.start_get, functools.partial(self._loaded, job))

    def _start(self, job: TransferJob, what: str, move: Any, answer: Any) -> None:
        """A job handed straight to a store that moves bytes on threads of its own
        (``move``: ``Shelf.start_put`` or ``start_get``) and answered by the one that finishes
        it (``answer(start, results, storage_keys)``; here if it cannot begin): one hand-off
        fewer than through this tier's threads (32 x 256 KiB loads from the file store: ~0.3
        ms of 2.5)."""
        start, storage_keys = time.monotonic(), list[str]()

        def done(results: list[bool] | None, error: BaseException | None) -> None:
            if error is not None:
                log.warning("kvtier tier %s job %d failed: %s", what, job.job_id, error)
            try:
                answer(start, results, storage_keys)
            finally:
                self._end_job()

        try:
            storage_keys += self._shelf.keys(list(job.keys))
            move(storage_keys, self._buffers(job.chunk_ids), done)
        except Exception as e:  # answered as a failed job, here
            done(None, e)

    def _put_done(
        self, job: TransferJob, start: float, stored: list[bool] | None, storage_keys: list[str]
    ) -> None:
        keys = list(job.keys)
        ok, moved = stored is not None and all(stored), 0
        if stored is not None:
            moved = sum(stored) * self.block_size_bytes
            self._record_stored(
                [k for k, s in zip(storage_keys, stored, strict=True) if s],
                [k for k, s in zip(keys, stored, strict=True) if s],
            )
        self._finished.put(JobResult(job.job_id, ok, None, time.monotonic() - start, moved or None))

    def _loaded(self, job: TransferJob, start: float, found: list[bool] | None, *_: object) -> None:
        keys = list(job.keys)
        found = found or [False] * len(keys)
        good = [k for k, f in zip(keys, found, strict=True) if f]
        ok = len(good) == len(keys)
        if not ok:
            self._lookups.mark_miss([k for k, f in zip(keys, found, strict=True) if not f])
        self._finished.put(
            JobResult(
                job.job_id,
                ok,
                None if ok else tuple(good) or None,
                time.monotonic() - start,
                len(good) * self.block_size_bytes or None,
            )
        )

    # ---- events ------------------------------------------------------------------------------

    def _record_stored(self, storage_keys: list[str], keys: list[OffloadKey]) -> None:
        if self._events is None or not keys:
            return
        with self._lock:
            self._keys_stored.update(zip(storage_keys, keys, strict=True))
            self._events.append(OffloadingEvent(keys, self.medium, False, self.locality))

    def _on_removed(self, storage_keys: list[str]) -> None:
        if self._events is None:
            return
        with self._lock:
            for storage_key in storage_keys:
                key = self._keys_stored.pop(storage_key, None)
                if key is not None:
                    self._removed.append(key)


def tier_config(**settings: Any) -> dict[str, Any]:
    """A ``secondary_tiers`` entry for this tier (``settings``: the module docstring's)."""
    return {"type": "KvtierTier", "module_path": __name__, **settings}
