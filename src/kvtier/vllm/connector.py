"""KvtierConnector: vLLM's KV connector API (0.32, 0.33, 0.34) on top of kvtier's workers.

vLLM builds one instance per role: the scheduler side (``SchedulerSide``: lookups, load and save
plans, fences) in the engine core, and one worker side per TP rank (``WorkerSide``: the shared
KV cache and this rank's kvtier worker). Methods of the other role are not called.

Roles (``kv_role``): ``kv_both`` looks up, loads and saves; ``kv_producer`` (a prefill instance
of a prefill/decode pair) saves every full prompt block and answers a request only once its
blocks are stored — no lookup, no load; ``kv_consumer`` (a decode instance) looks up and loads,
never saves. ``kvtier pd-proxy`` sends each request to a producer, then to a consumer.

Failure policy: a failed or short load is reported block by block for recompute. vLLM's default
``kv_load_failure_policy="fail"`` would abort such requests instead; the connector switches it
to ``"recompute"`` with one warning (a KV cache miss must cost time, never a request).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from kvtier.errors import ConfigError
from kvtier.storage import describe_backend
from kvtier.vllm.events import KvtierKVEvents, RankEventLog, TierEvents, publishing
from kvtier.vllm.metadata import KvtierMetadata
from kvtier.vllm.settings import ConnectorSettings, default_namespace, instance_name
from kvtier.vllm.stats import KvtierConnectorStats, KvtierPromMetrics

log = logging.getLogger(__name__)

ROLES = ("kv_both", "kv_producer", "kv_consumer")


class KvtierConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        try:
            self._set_up(vllm_config, role, kv_cache_config)
        except ConfigError as e:  # one clear line before vLLM's tracebacks
            log.error("kvtier: invalid configuration: %s", e)
            raise

    def _set_up(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any) -> None:
        transfer = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        role_name = str(transfer.kv_role or "kv_both")
        if role_name not in ROLES:
            raise ConfigError("kv_role", f"got {role_name!r}; allowed: {', '.join(ROLES)}")
        self.kv_role = role_name
        instance = self.settings.instance_id or instance_name(vllm_config.instance_id)
        world_size = vllm_config.parallel_config.tensor_parallel_size
        if vllm_config.parallel_config.pipeline_parallel_size != 1:
            raise ValueError("kvtier's vLLM connector supports pipeline_parallel_size=1")
        namespace = self.settings.namespace or default_namespace(
            vllm_config.model_config.model, vllm_config.cache_config.prefix_caching_hash_algo
        )
        if "." not in namespace:
            namespace += "." + vllm_config.cache_config.prefix_caching_hash_algo
        self._scheduler = None
        self._worker = None
        # Under async scheduling a step's output comes after the next step began: no end seen.
        scheduling = getattr(vllm_config, "scheduler_config", None)
        self._steps_end_here = not getattr(scheduling, "async_scheduling", False)
        self._tier_events: TierEvents | None = None
        scheduler = role is KVConnectorRole.SCHEDULER
        events = publishing(vllm_config, self.settings.kv_events, warn=scheduler)
        if scheduler:
            if transfer.kv_load_failure_policy != "recompute":
                log.warning(
                    "kvtier: kv_load_failure_policy %r would abort requests whose KV load "
                    "fails; using 'recompute' (failed blocks are recomputed)",
                    transfer.kv_load_failure_policy,
                )
                transfer.kv_load_failure_policy = "recompute"
            from kvtier.vllm.scheduler import SchedulerSide

            block_size = kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size
            self._scheduler = SchedulerSide(
                instance, world_size, block_size, self.settings, role=self.kv_role
            )
            if events:
                backend = describe_backend(self.settings.storage_config)
                self._tier_events = TierEvents(world_size, block_size, backend)
        else:
            from kvtier.vllm.worker import WorkerSide

            self._worker = WorkerSide(
                vllm_config,
                kv_cache_config,
                instance,
                get_tensor_model_parallel_rank(),
                world_size,
                self.settings,
                namespace,
                role=self.kv_role,
            )
            if events:
                self._worker.transfers.events = RankEventLog(self._worker.rank)

    # ---- what this connector supports (asked by vLLM; later releases ask more) -------------

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a save that does not happen is a future miss, never a lost result. Also for
        a producer: its consumer recomputes what was not stored."""
        return False

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """kvtier stores attention KV blocks only, never a hybrid model's recurrent state."""
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM >= 0.33. On CUDA, kvtier shares the device cache with its worker by legacy CUDA
        IPC handles, which cannot export the CuMemAllocator (VMM) allocation that sleep mode
        puts the KV cache in: refused there (vLLM says so at start) rather than failing at
        the first transfer. Elsewhere the cache is kvtier's shared-memory segment and the
        sleep hooks below detach and re-attach the worker's mapping."""
        return str(getattr(kv_transfer_config, "kv_buffer_device", "cpu")) == "cpu"

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM >= 0.34: how kvtier's worker reaches the device cache — another process, by
        legacy CUDA IPC on CUDA (the extensible KV cache is unsupported), in shared memory
        that kvtier provides on CPU."""
        # local: only vLLM >= 0.34 has it (and asks this); the type checker sees 0.32
        from vllm.config.kv_transfer import KVCacheAccess  # type: ignore[attr-defined]

        if str(getattr(kv_transfer_config, "kv_buffer_device", "cpu")) == "cpu":
            return KVCacheAccess.IN_PROCESS
        return KVCacheAccess.LEGACY_IPC

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        """vLLM >= 0.34. kvtier's keys are vLLM's hashes of full prompt blocks, looked up once
        per request; hashes computed ahead of the tokens are not used (the default)."""
        return False

    def may_load_async(self, request: Any) -> bool:
        """vLLM >= 0.34 (``--max-num-inflight-kv-loads``): True when this request's lookup
        already found stored blocks and loads are asynchronous — cheap, and never a guess
        before the lookup (a false positive would hold back other requests' loads)."""
        return self._scheduler is not None and self._scheduler.may_load_async(request)

    # ---- worker side ------------------------------------------------------------------------

    def get_mem_pool_context(self):
        return self._worker.mem_pool_context() if self._worker is not None else None

    def register_kv_caches(self, kv_caches) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.transfers.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: nothing to wait for per layer."""

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        """Saves are submitted once per step in ``wait_for_save``, all layers at once."""

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.transfers.wait_for_save(self._meta())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self._worker is not None and isinstance(kv_connector_metadata, KvtierMetadata):
            self._worker.transfers.handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]):
        assert self._worker is not None
        meta = self._connector_metadata
        idle = isinstance(meta, KvtierMetadata) and meta.idle
        return self._worker.transfers.get_finished(finished_req_ids, idle)

    def unregister_kv_caches(self) -> None:
        """vLLM >= 0.33, before sleep (transfers already drained): the kvtier worker drops its
        mapping of the cache. Idempotent."""
        if self._worker is not None:
            self._worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM >= 0.33, after wake-up: the kvtier worker maps the cache again. Idempotent."""
        if self._worker is not None:
            self._worker.restore_kv_caches()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.transfers.load_errors() if self._worker else set()

    def build_connector_worker_meta(self):
        return self._worker.transfers.worker_meta() if self._worker is not None else None

    def get_kv_connector_stats(self):
        if self._scheduler is not None and self._steps_end_here:
            self._scheduler.decide.step_ended()  # vLLM asks once each step's output is in
        return self._worker.transfers.take_stats() if self._worker is not None else None

    def get_kv_connector_kv_cache_events(self) -> KvtierKVEvents | None:
        """This rank's news of what kvtier stored and removed (``kvtier.vllm.events``)."""
        if self._worker is None or self._worker.transfers.events is None:
            return None
        return self._worker.transfers.events.take()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.close()

    def _meta(self) -> KvtierMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierMetadata)
        return meta

    # ---- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)
        reports = getattr(connector_output, "kv_cache_events", None)
        if self._tier_events is not None and isinstance(reports, KvtierKVEvents):
            self._tier_events.add(reports.reports)

    def take_events(self):
        """vLLM KV events of what kvtier stored and removed since the last step."""
        return self._tier_events.take() if self._tier_events is not None else ()

    def request_finished(self, request, block_ids):
        assert self._scheduler is not None
        return self._scheduler.request_finished(request)

    def reset_cache(self) -> bool | None:
        return self._scheduler.reset_cache() if self._scheduler is not None else None

    # ---- stats ------------------------------------------------------------------------------

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return KvtierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
