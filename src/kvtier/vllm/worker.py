"""The worker side: this vLLM rank's KV cache shared with its own kvtier worker process.

On CPU the KV cache lives in a kvtier shared-memory segment from the start: the connector
creates the segment (placed exactly as vLLM will lay the cache out) and its
``get_mem_pool_context`` makes vLLM's one KV allocation return that memory, so the engine's
tensors and the kvtier worker's mapping are the same bytes. On CUDA the tensors vLLM allocated
are shared by IPC handle (``DeviceCache.wrap`` + ``publish``). Either way the kvtier worker for
this rank (``Client.launch`` with ``ranks=[rank]``) attaches the cache and runs every load and
save as a kvtier task; this process only submits tasks and collects their answers.

Loads and saves are asynchronous. A load's answer names the prefix of blocks it filled; the
rest are reported through ``get_block_ids_with_load_errors`` in the same step the request is
reported finished receiving, so vLLM recomputes exactly those.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kvtier import tasks as t
from kvtier.client import Client
from kvtier.device import DeviceCache, cache_name
from kvtier.errors import DeviceCacheError, KvtierError
from kvtier.launcher import Launch, start_workers, worker_configs
from kvtier.spec import Part
from kvtier.vllm.layout import layer_order, spec_and_layout
from kvtier.vllm.metadata import KvtierMetadata, KvtierWorkerMetadata, LoadSpec
from kvtier.vllm.settings import PREFIX
from kvtier.vllm.stats import KvtierConnectorStats

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # an idle step waits at most this long for an in-flight load


class _AllocateInto(TorchFunctionMode):
    """While active, vLLM's one ``torch.zeros(size, dtype=int8)`` KV allocation returns
    ``buffer`` (already zeroed) instead of fresh memory; every other call runs as usual."""

    def __init__(self, buffer: torch.Tensor) -> None:
        super().__init__()
        self.buffer = buffer
        self.used = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.zeros and not self.used and self._is_kv_allocation(args, kwargs):
            self.used = True
            return self.buffer
        return func(*args, **kwargs)

    def _is_kv_allocation(self, args: tuple, kwargs: dict) -> bool:
        size = args[0] if args else kwargs.get("size")
        device = torch.device(kwargs.get("device") or "cpu")
        return (
            isinstance(size, int)
            and size == self.buffer.numel()
            and kwargs.get("dtype") == torch.int8
            and device.type == "cpu"
        )


class WorkerSide:
    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        instance: str,
        rank: int,
        world_size: int,
        settings: Any,
        namespace: str,
    ) -> None:
        self.rank, self.world_size, self.instance = rank, world_size, instance
        self.settings, self.namespace = settings, namespace
        self.device_type = vllm_config.device_config.device_type
        self.kv_cache_config = kv_cache_config
        self.spec, self.layout = spec_and_layout(vllm_config, kv_cache_config, self.device_type)
        self.name = cache_name(instance, rank)
        self.cache: DeviceCache | None = None
        self.launch: Launch | None = None
        self.client: Client | None = None
        self._allocation: _AllocateInto | None = None
        self._loads: dict[str, tuple[Future, LoadSpec]] = {}
        self._saves: dict[str, list[Future]] = defaultdict(list)
        self._finished: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_hashes: set[bytes] = set()
        self.stats = KvtierConnectorStats()
        self._stats_lock = threading.Lock()  # saves are counted from the client's I/O thread
        if self.device_type == "cpu":
            # The segment exists before vLLM allocates, so the worker can start now, in
            # parallel with the rest of vLLM's start-up.
            self.cache = DeviceCache.create(self.spec, self.name, "cpu", self.layout)
            self._start_worker()

    def _start_worker(self) -> None:
        s = self.settings
        settings: dict[str, Any] = {
            "namespace": self.namespace,
            "device_cache_mode": "attach",
            "device": "cpu" if self.device_type == "cpu" else f"cuda:{torch.cuda.current_device()}",
            "num_host_blocks": 1,  # vLLM's connector moves device <-> storage only
            "staging_blocks": s.staging_blocks,
            "version": s.version,
            "model_dir": s.model_dir,
            "start_timeout_s": s.start_timeout_s,  # vLLM says hello after loading its weights
        }
        if s.metrics_port is not None:
            settings["metrics_port"] = s.metrics_port
        configs = worker_configs(
            self.spec, self.world_size, s.storage, self.instance, [self.rank], settings, PREFIX
        )
        self.launch = start_workers(configs, s.log_dir)

    # ---- the KV cache -----------------------------------------------------------------------

    def mem_pool_context(self) -> TorchFunctionMode | None:
        if self.cache is None:
            return None
        buffer = self.cache.data[: self.layout.data_bytes].view(torch.int8)
        self._allocation = _AllocateInto(buffer)
        return self._allocation

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = layer_order(self.kv_cache_config)
        tensors = [kv_caches[name] for name in names]
        if self.cache is not None:
            for layer, tensor in enumerate(tensors):
                expected = self.cache.tensor(layer, Part.KEY_VALUE)
                if tensor.data_ptr() != expected.data_ptr() or tensor.shape != expected.shape:
                    raise DeviceCacheError(
                        f"vLLM's KV cache for {names[layer]} is not in kvtier's shared segment "
                        "(the allocation hook was not used): this vLLM is not supported"
                    )
        else:  # CUDA: share the tensors vLLM allocated by IPC handle
            self.cache = DeviceCache.wrap(self.spec, tensors)
            self.cache.publish(self.name)
            self._start_worker()
        assert self.launch is not None
        self.client = Client.from_launch(
            self.launch,
            start_timeout_s=self.settings.start_timeout_s,
            task_timeout_s=self.settings.task_timeout_s,
        )
        log.info(
            "kvtier: rank %d of %d serving %d blocks of %d KiB (%s)",
            self.rank,
            self.world_size,
            self.spec.num_blocks,
            self.spec.block_bytes // 1024,
            self.spec.engine_layout,
        )

    # ---- each step --------------------------------------------------------------------------

    def start_load_kv(self, meta: KvtierMetadata) -> None:
        if self.rank == 0 and meta.lookup_counts:
            self._count(**meta.lookup_counts)  # the scheduler's counts, reported once
        sync = []
        for spec in meta.loads:
            task = t.Load(block_hashes=spec.block_hashes, device_block_ids=spec.block_ids)
            future = self._submit(task)
            if spec.sync:
                sync.append((future, spec))
            else:
                self._loads[spec.req_id] = (future, spec)
        for future, spec in sync:  # this step's forward reads these blocks: wait for them
            _wait(future)
            self._account_load(future, spec)

    def wait_for_save(self, meta: KvtierMetadata) -> None:
        """Submit this step's saves; never waits for them (they finish off the critical path)."""
        for spec in meta.saves:
            task = t.Save(block_hashes=spec.block_hashes, device_block_ids=spec.block_ids)
            future = self._submit(task)
            future.add_done_callback(self._account_save)  # counted when answered
            self._saves[spec.req_id].append(future)

    def handle_preemptions(self, meta: KvtierMetadata) -> None:
        """A preempted request's blocks are reused this step: its saves must have read them."""
        for req_id in meta.preempted:
            for future in self._saves.get(req_id, ()):
                _wait(future)

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
        if idle and self._loads:
            # Nothing else to run this step: wait for a load here instead of letting vLLM spin
            # through empty steps (the spin takes the CPU the kvtier worker is loading with).
            futures = [f for f, _ in self._loads.values()]
            wait(futures, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        recving = {req_id for req_id, (f, _) in self._loads.items() if f.done()}
        for req_id in recving:
            future, spec = self._loads.pop(req_id)
            self._account_load(future, spec)
        self._finished |= finished_req_ids & set(self._saves)
        sending = set()
        for req_id in list(self._finished):
            futures = self._saves[req_id]
            if all(f.done() for f in futures):
                sending.add(req_id)
                self._finished.discard(req_id)
                del self._saves[req_id]
        for req_id in finished_req_ids - set(self._saves) - set(self._loads):
            self._saves.pop(req_id, None)
        return sending, recving

    def _account_load(self, future: Future, spec: LoadSpec) -> None:
        try:
            result: t.Result = future.result()
            loaded = len(result.blocks)
            self._count(load_bytes=result.bytes_moved, load_microseconds=int(result.seconds * 1e6))
        except Exception as e:  # lost worker, timeout: every block of it is recomputed
            log.warning("kvtier load for %s failed: %s", spec.req_id, e)
            loaded = 0
        failed = spec.block_ids[loaded:]
        self._load_errors.update(failed)
        self._failed_hashes.update(spec.block_hashes[loaded:])
        bs = self.spec.block_size
        self._count(loaded_tokens=loaded * bs, failed_tokens=len(failed) * bs)

    def _account_save(self, future: Future) -> None:
        try:
            result: t.Result = future.result()
            bs = self.spec.block_size
            self._count(
                saved_tokens=(len(result.blocks) - result.count) * bs,
                skipped_tokens=result.count * bs,
                save_bytes=result.bytes_moved,
            )
            if result.status is not t.Status.OK:
                self._count(save_failures=1)
        except Exception:
            self._count(save_failures=1)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_worker_meta(self) -> KvtierWorkerMetadata | None:
        if not self._failed_hashes:
            return None
        meta, self._failed_hashes = KvtierWorkerMetadata(self._failed_hashes), set()
        return meta

    def _count(self, **counts: float) -> None:
        with self._stats_lock:
            self.stats.add(**counts)

    def take_stats(self) -> KvtierConnectorStats | None:
        with self._stats_lock:
            if self.stats.is_empty():
                return None
            stats, self.stats = self.stats, KvtierConnectorStats()
        return stats

    def shutdown(self) -> None:
        for future, _ in self._loads.values():
            _wait(future)
        for futures in self._saves.values():
            for future in futures:
                _wait(future)
        if self.client is not None:
            self.client.close()  # shuts the launched worker down cleanly
            self.client = None
        elif self.launch is not None:
            self.launch.kill()
            self.launch.remove_directory()
        if self.cache is not None:
            self.cache.close()
            self.cache = None


def _wait(future: Future, timeout_s: float = 120.0) -> None:
    try:
        future.result(timeout_s)
    except Exception:  # answered with an error, lost or timed out: the bytes are not read
        pass
