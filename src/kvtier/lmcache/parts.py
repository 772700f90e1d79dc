"""What the LMCache adapter reads and writes besides its tasks: its settings
(``adapter_params``), the key context LMCache keeps outside its hash, and the objects' bytes
(slices of LMCache's L1 arena, or each object's own tensor)."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from kvtier.errors import ConfigError
from kvtier.hosted.settings import HostedSettings
from kvtier.hosted.shelf import as_block

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.internal_api import L1MemoryDesc
    from lmcache.v1.memory_management import MemoryObj

DEFAULT_NAMESPACE = "lmcache"
MAX_WORKERS = 64


class KvtierL2AdapterConfig(L2AdapterConfigBase):
    """``adapter_params`` (module docstring), checked with the field named."""

    def __init__(self, settings: HostedSettings, workers: int, object_bytes: tuple[int, ...]):
        self.settings = settings
        self.workers = workers
        self.object_bytes = object_bytes

    @classmethod
    def from_dict(cls, d: dict) -> KvtierL2AdapterConfig:
        settings = HostedSettings.parse(d, "adapter_params", ignore=("workers", "object_bytes"))
        if not settings.namespace:
            settings = HostedSettings(
                settings.storage, DEFAULT_NAMESPACE, settings.weight_version, settings.model_dir
            )
        workers = d.get("workers", 4)
        if isinstance(workers, bool) or not isinstance(workers, int):
            raise ConfigError("adapter_params.workers", f"must be an integer, got {workers!r}")
        if not 1 <= workers <= MAX_WORKERS:
            raise ConfigError("adapter_params.workers", f"must be 1..{MAX_WORKERS}")
        sizes = d.get("object_bytes", [])
        sizes = [sizes] if isinstance(sizes, int) else sizes
        if not isinstance(sizes, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes
        ):
            raise ConfigError("adapter_params.object_bytes", "must be sizes in bytes (> 0)")
        return cls(settings, workers, tuple(sizes))

    @classmethod
    def help(cls) -> str:
        return (
            "kvtier L2 adapter settings (docs/lmcache.md): storage (a kvtier storage mapping), "
            "namespace, weight_version or model_dir, workers (1-64), object_bytes"
        )


def key_context(key: ObjectKey) -> bytes:
    """What besides the chunk hash makes an LMCache key unique: its rank (LMCache packs the
    whole geometry into ``kv_rank``), object group, cache salt and model."""
    salt = key.cache_salt.encode()
    model = key.model_name.encode()
    return struct.pack("<QII", key.kv_rank, key.object_group_id, len(salt)) + salt + model


class L1View:
    """LMCache's L1 arena (``L1MemoryDesc``) as one flat uint8 tensor: an object in it is a
    slice, where building a tensor for each object costs a few microseconds each time."""

    def __init__(self, desc: L1MemoryDesc) -> None:
        self.base, self.size = desc.ptr, desc.size
        arena = (ctypes.c_ubyte * desc.size).from_address(desc.ptr)
        self.flat = torch.frombuffer(arena, dtype=torch.uint8)

    def block(self, address: int, nbytes: int) -> torch.Tensor | None:
        at = address - self.base
        if at < 0 or at + nbytes > self.size:
            return None
        return self.flat[at : at + nbytes]


def object_block(obj: MemoryObj) -> torch.Tensor:
    """The object's bytes as a flat uint8 tensor, without a copy: its tensor where it has a
    plain CPU one (LMCache's ``byte_array`` builds a ctypes array on every call)."""
    raw = obj.raw_tensor
    size = obj.get_size()
    if isinstance(raw, torch.Tensor) and raw.is_contiguous() and raw.device.type == "cpu":
        flat = raw.view(torch.uint8).reshape(-1)
        if flat.numel() >= size:
            return flat[:size]
    return as_block(obj.byte_array)


def by_size(objects: Sequence[MemoryObj]) -> dict[int, list[int]]:
    """Indices of ``objects`` by their size in bytes (almost always one size)."""
    groups: dict[int, list[int]] = {}
    for i, obj in enumerate(objects):
        groups.setdefault(obj.get_size(), []).append(i)
    return groups
