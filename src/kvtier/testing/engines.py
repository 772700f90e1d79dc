"""The engines' sides a hosted surface meets, where they run without a GPU: an SGLang host KV
pool laid out as SGLang 0.5.23 lays it out, and vLLM's native offloading scheduler side built by
vLLM from its configuration. Used by kvtier's tests and ``kvtier bench hosted``.

SGLang's own host pool classes (``sglang.srt.mem_cache.pool_host``) import its model configs,
which import torchvision (a CUDA build on PyPI, which breaks transformers beside the CPU torch);
``SGLangHostPool`` is real memory in their layouts, answering ``get_page_buffer_meta`` with
0.5.23's formulas (``pool_host/mha.py``: ``MHATokenToKVPoolHost`` and its MLA twin).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import torch


class SGLangHostPool:
    """SGLang's host KV pool: one buffer, and each page's buffers as ``get_page_buffer_meta``
    names them (MHA: K and V; MLA: one), in the ``page_first`` or ``layer_first`` layout."""

    def __init__(
        self,
        layout: str = "page_first",
        mla: bool = False,
        layers: int = 3,
        heads: int = 2,
        head_dim: int = 16,
        page_size: int = 4,
        pages: int = 16,
    ) -> None:
        self.layout, self.mla, self.page_size = layout, mla, page_size
        self.layer_num, self.head_num, self.head_dim = layers, 1 if mla else heads, head_dim
        self.dtype = torch.bfloat16
        self.size = page_size * pages
        token = (self.head_num, self.head_dim)
        shape = (layers, self.size) if layout == "layer_first" else (self.size, layers)
        self.kv_buffer = torch.zeros(((1,) if mla else (2,)) + shape + token, dtype=self.dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        item = self.dtype.itemsize
        per_token = self.head_num * self.head_dim * item
        base = self.kv_buffer.data_ptr()
        v_offset = self.layer_num * self.size * per_token
        ptrs: list[int] = []
        size = 0
        for first in indices.tolist()[:: self.page_size]:
            if self.layout == "layer_first":
                for layer in range(self.layer_num):
                    k = base + first * per_token + layer * self.size * per_token
                    ptrs += [k] if self.mla else [k, k + v_offset]
                size = self.page_size * per_token
            else:
                k = base + first * self.layer_num * per_token
                ptrs += [k] if self.mla else [k, k + v_offset]
                size = self.layer_num * self.page_size * per_token
        return ptrs, [size] * len(ptrs)

    def indices(self, pages: list[int]) -> torch.Tensor:
        size = self.page_size
        return torch.cat([torch.arange(p * size, (p + 1) * size) for p in pages])

    def page_bytes(self, page: int) -> bytes:
        """A page's bytes, its buffers in order (what a backend stores for it)."""
        ptrs, sizes = self.get_page_buffer_meta(self.indices([page]))
        flat = self.kv_buffer.view(torch.uint8).reshape(-1)
        base = self.kv_buffer.data_ptr()
        return b"".join(bytes(flat[p - base : p - base + n].numpy()) for p, n in zip(ptrs, sizes))

    def fill(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        raw = self.kv_buffer.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


class VllmOffloading:
    """vLLM's scheduler side of native offloading (``TieringOffloadingSpec``), built by vLLM
    from its configuration over a real CPU tier in /dev/shm, with ``tier_settings`` as its one
    secondary tier (``kvtier.vllm.tier``), driven as vLLM's scheduler drives it."""

    def __init__(
        self,
        tier_settings: dict[str, Any],
        row_bytes: int = 8192,
        chunks: int = 8,
        tp_size: int = 1,
        events: bool = True,
        wait_s: float = 30.0,
    ) -> None:
        # local: vLLM is imported only where its offloading is driven
        from vllm.v1.kv_offload.base import ScheduleEndContext
        from vllm.v1.kv_offload.config import (
            OffloadingCacheConfig,
            OffloadingConfig,
            OffloadingGroupConfig,
            OffloadingModelConfig,
            OffloadingParallelConfig,
        )
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        from kvtier.vllm.tier import tier_config

        self.engine_id = f"kvtiertest{uuid.uuid4().hex[:10]}"
        self.wait_s = wait_s
        self.step = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(16, ("layer.0", "layer.1"), 0),),
            worker_kv_bytes_per_block=row_bytes // tp_size,
            enable_kv_cache_events=events,
            extra_config={
                "cpu_bytes_to_use": row_bytes * chunks,
                "secondary_tiers": [tier_config(**tier_settings)],
            },
            engine_id=self.engine_id,
            model=OffloadingModelConfig("org/model", "bfloat16"),
            cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
            parallel=OffloadingParallelConfig(0, tp_size, tp_size, 1, 1, 1, 0, 1, None, False),
        )
        self.spec = TieringOffloadingSpec(config)
        try:
            manager: Any = self.spec.get_manager()  # a TieringOffloadingManager
        except BaseException:
            self._unlink_region()
            raise
        self.manager = manager
        self.tier = manager.secondary_tiers[0]
        view = manager.primary_tier.get_kv_memoryview()
        self.rows = torch.frombuffer(view.cast("B"), dtype=torch.uint8).view(chunks, -1)
        self._requests = 0

    def request(self) -> Any:
        from vllm.v1.kv_offload.base import ReqContext  # local: see __init__

        self._requests += 1
        ctx = ReqContext(req_id=f"r{self._requests}")
        self.manager.on_new_request(ctx)
        return ctx

    def offload(self, keys: list, data: torch.Tensor) -> None:
        """What vLLM does when blocks leave the GPU: CPU chunks, then the cascade to the tier."""
        ctx = self.request()
        out: Any = self.manager.prepare_store(keys, ctx)
        if out is None or list(out.keys_to_store) != list(keys):
            raise RuntimeError(f"vLLM's CPU tier took {out and out.keys_to_store} of {keys}")
        for row, chunk in zip(data, out.store_spec.block_ids, strict=True):
            self.rows[chunk].copy_(row)
        self.manager.complete_store(keys, ctx)
        self.settle()

    def settle(self) -> None:
        deadline = time.monotonic() + self.wait_s
        while self.tier.has_pending_work() or self.manager.has_pending_work():
            if time.monotonic() > deadline:
                raise TimeoutError("the tier did not finish its jobs")
            self.manager.on_schedule_end(self.step)
            time.sleep(0.001)
        self.manager.on_schedule_end(self.step)

    def forget_cpu(self) -> None:
        """vLLM's reset (sleep, weight update): the CPU tier forgets; the tier keeps."""
        self.manager.reset_cache()
        self.rows.zero_()

    def find(self, keys: list) -> list:
        """Look ``keys`` up as the scheduler does, step after step, until each is answered (a
        tier hit is promoted into the CPU tier first)."""
        from vllm.v1.kv_offload.base import LookupResult  # local: see __init__

        ctx = self.request()
        deadline = time.monotonic() + self.wait_s
        waiting = {LookupResult.RETRY, LookupResult.HIT_PENDING}
        while True:
            results = [self.manager.lookup(k, ctx) for k in keys]
            if not waiting & set(results):
                return results
            if time.monotonic() > deadline:
                raise TimeoutError(f"lookups not answered: {results}")
            self.manager.on_schedule_end(self.step)
            time.sleep(0.001)

    def cpu_rows(self, keys: list) -> torch.Tensor:
        spec: Any = self.manager.prepare_load(keys, self.request())
        return torch.stack([self.rows[c].clone() for c in spec.block_ids])

    def close(self) -> None:
        del self.rows
        self.manager.shutdown()
        self._unlink_region()

    def _unlink_region(self) -> None:
        # The scheduler's region, made here (no vLLM workers to remove it).
        Path(f"/dev/shm/vllm_offload_{self.engine_id}.mmap").unlink(missing_ok=True)
