"""The worker side: this vLLM rank's KV cache shared with its own kvtier worker process.

On CPU the KV cache lives in a kvtier shared-memory segment from the start: the connector
creates the segment (placed exactly as vLLM will lay the cache out) and its
``get_mem_pool_context`` makes vLLM's one KV allocation return that memory, so the engine's
tensors and the kvtier worker's mapping are the same bytes. On CUDA the tensors vLLM allocated
are shared by IPC handle (``DeviceCache.wrap`` + ``publish``). Either way the kvtier worker for
this rank (``Client.launch`` with ``ranks=[rank]``) attaches the cache and runs every load and
save as a kvtier task; this process only submits tasks and collects their answers.

Each step's loads and saves are ``StepTransfers`` (``kvtier.vllm.transfers``): asynchronous
kvtier tasks whose answers say which requests finished and which blocks vLLM must recompute.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from kvtier.common.cpus import format_cpu_list
from kvtier.engine.client import Client
from kvtier.engine.launcher import Launch, start_workers, worker_configs
from kvtier.errors import DeviceCacheError
from kvtier.layout.spec import Part
from kvtier.memory.device import DeviceCache, cache_name
from kvtier.vllm.layout import layer_order, spec_and_layout
from kvtier.vllm.placement import for_this_rank
from kvtier.vllm.settings import PREFIX
from kvtier.vllm.transfers import StepTransfers

log = logging.getLogger(__name__)


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
        role: str = "kv_both",
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
        self._cuda_tensors: list[torch.Tensor] = []  # published again after a wake-up
        self.transfers = StepTransfers(self.spec.block_size, rank, role == "kv_producer")
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
        if s.worker_cores == "reserved":
            where = for_this_rank()
            if where.cores:
                settings["cpu_cores"] = format_cpu_list(where.cores)
            log.info("kvtier: rank %d's worker runs %s", self.rank, where.note)
        elif s.worker_cores != "inherit":
            settings["cpu_cores"] = s.worker_cores
        configs = worker_configs(
            self.spec, self.world_size, s.storage, self.instance, [self.rank], settings, PREFIX
        )
        # vLLM SIGKILLs its workers' whole process trees: the reaper, outside it, cleans up.
        self.launch = start_workers(configs, s.log_dir, reaper_too=True)

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
            self._cuda_tensors = tensors
            self.cache = DeviceCache.wrap(self.spec, tensors)
            self.cache.publish(self.name)
            self._start_worker()
        assert self.launch is not None
        self.client = Client.from_launch(
            self.launch,
            start_timeout_s=self.settings.start_timeout_s,
            task_timeout_s=self.settings.task_timeout_s,
        )
        self.transfers.client = self.client
        log.info(
            "kvtier: rank %d of %d serving %d blocks of %d KiB (%s)",
            self.rank,
            self.world_size,
            self.spec.num_blocks,
            self.spec.block_bytes // 1024,
            self.spec.engine_layout,
        )

    # ---- sleep (vLLM >= 0.33) -----------------------------------------------------------------

    def unregister_kv_caches(self) -> None:
        """Before vLLM sleeps: the kvtier worker drops its mapping, so the memory really goes
        back once vLLM frees it. vLLM has drained transfers; idempotent (sleep twice is 200)."""
        self._control("sleep")

    def restore_kv_caches(self) -> None:
        """After vLLM wakes: on CUDA the tensors' IPC handles are published again (the memory
        behind them is new), then the kvtier worker maps the cache again. Idempotent."""
        if self._cuda_tensors and self.cache is not None:
            self.cache.close()  # the old handles' file: gone before the new one is published
            self.cache = DeviceCache.wrap(self.spec, self._cuda_tensors)
            self.cache.publish(self.name)
        self._control("wakeup")

    def _control(self, method: str) -> None:
        if self.client is None:
            return  # not registered yet: nothing is mapped
        answer = self.client.control(method, timeout_s=self.settings.task_timeout_s)
        if answer.code != 200:
            raise DeviceCacheError(f"kvtier worker of rank {self.rank}: {method}: {answer.message}")

    def shutdown(self) -> None:
        self.transfers.drain()
        self.transfers.client = None
        if self.client is not None:
            self.client.close()  # shuts the launched worker down cleanly
            self.client = None
        elif self.launch is not None:
            self.launch.kill()
            self.launch.remove_directory()
        if self.cache is not None:
            self.cache.close()
            self.cache = None
