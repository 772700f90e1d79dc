"""The KVCacheSpec and segment placement of vLLM's KV cache, read from its KVCacheConfig.

vLLM 0.32 hands one fused K|V tensor per layer, ``[num_blocks, num_kv_heads, block_size,
2 * head_size]``, all layers views of one buffer, layer ``l`` at ``offset + l * layer_stride``,
block ``b`` at ``+ b * block_stride``. The inner byte order depends on the attention backend
(the CPU "vec" kernels keep K transposed per head; the GPU flash backend splits K|V per token):
``engine_layout`` names it, and it is part of the layout fingerprint, so objects written by one
backend are never loaded by another.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvtier.errors import ConfigError
from kvtier.layout.spec import CacheDType, KVCacheSpec, KVLayout
from kvtier.memory.segment import SegmentLayout

log = logging.getLogger(__name__)

_DTYPES = {
    torch.float32: CacheDType.FLOAT32,
    torch.float16: CacheDType.FLOAT16,
    torch.bfloat16: CacheDType.BFLOAT16,
}


def kv_tensor(kv_cache_config: Any) -> Any:
    """The one KVCacheTensor kvtier supports (a single full-attention group)."""
    groups = kv_cache_config.kv_cache_groups
    tensors = kv_cache_config.kv_cache_tensors
    if len(groups) != 1 or len(tensors) != 1:
        raise ConfigError(
            "kv_cache_config",
            f"kvtier supports models with one full-attention KV cache group; this one has "
            f"{len(groups)} groups over {len(tensors)} tensors",
        )
    return tensors[0]


def engine_layout_tag(vllm_config: Any, device_type: str, spec: Any) -> str:
    """Names the byte order inside a block: ``vllm-cpu-<isa>`` or ``vllm-cuda-<backend>``."""
    if device_type == "cpu":
        try:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(
                spec.dtype, spec.block_size, spec.head_size, vllm_config.cache_config.cache_dtype
            )
        except Exception as e:  # a private helper of vLLM 0.32: name the backend without it
            log.warning("could not read vLLM's CPU attention ISA (%s): tagging as 'cpu'", e)
            isa = "unknown"
        return f"vllm-cpu-{isa}"
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backend

        backend = get_current_attn_backend(vllm_config).get_name()
    except Exception as e:
        log.warning("could not read vLLM's attention backend (%s)", e)
        backend = "unknown"
    return f"vllm-{device_type}-{backend}".lower()[:64]


def spec_and_layout(
    vllm_config: Any, kv_cache_config: Any, device_type: str
) -> tuple[KVCacheSpec, SegmentLayout]:
    """The spec of this rank's cache and where each layer sits in vLLM's buffer."""
    tensor = kv_tensor(kv_cache_config)
    group_spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    dtype = _DTYPES.get(group_spec.dtype)
    if dtype is None:
        raise ConfigError(
            "cache_dtype",
            f"kvtier moves float32, float16 and bfloat16 KV caches; got {group_spec.dtype}",
        )
    spec = KVCacheSpec(
        num_layers=len(tensor.layers),
        num_blocks=kv_cache_config.num_blocks,
        num_kv_heads=group_spec.num_kv_heads,
        block_size=group_spec.block_size,
        head_dim=group_spec.head_size,
        dtype=dtype,
        kv_layout=KVLayout.FUSED,
        engine_layout=engine_layout_tag(vllm_config, device_type, group_spec),
    )
    pieces = tuple(
        (tensor.offset + layer * tensor.layer_stride, tensor.block_stride)
        for layer in range(len(tensor.layers))
    )
    layout = SegmentLayout(pieces, tensor.size)
    layout.check(spec)
    return spec, layout


def layer_order(kv_cache_config: Any) -> list[str]:
    """vLLM's layer names in kvtier's layer order."""
    return list(kv_tensor(kv_cache_config).layers)
