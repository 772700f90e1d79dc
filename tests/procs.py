"""Functions run in child processes (spawned) by the multi-process tests."""

from __future__ import annotations

import os
import signal

import torch

from kvtier.copier import make_copier
from kvtier.device import DeviceCache
from kvtier.host import HostPool
from kvtier.spec import KVCacheSpec


def attach_and_write(spec_dict: dict, name: str, block: int, value: int) -> None:
    spec = KVCacheSpec.from_dict(spec_dict)
    cache = DeviceCache.attach(spec, name)
    for row in cache.tensors:
        for t in row:
            t[block].view(torch.uint8).fill_(value)
    cache.close()


def attach_and_move_block(spec_dict: dict, name: str, src_block: int, dst_block: int) -> None:
    """Swap device block src out to a host pool and back in as dst — in another process."""
    spec = KVCacheSpec.from_dict(spec_dict)
    with DeviceCache.attach(spec, name) as cache, HostPool(spec, 4) as pool:
        copier = make_copier(cache, pool)
        copier.swap_out([src_block], [2])
        copier.swap_in([2], [dst_block])


def create_and_die(spec_dict: dict, name: str) -> None:
    """Create a device cache and get SIGKILLed without closing it (a crashed owner)."""
    DeviceCache.create(KVCacheSpec.from_dict(spec_dict), name)
    os.kill(os.getpid(), signal.SIGKILL)


def read_shared_pool(spec_dict: dict, pool_name: str, num_blocks: int, block: int) -> bytes:
    spec = KVCacheSpec.from_dict(spec_dict)
    pool = HostPool.open_shared(spec, pool_name, num_blocks)
    data = bytes(pool.block(block).numpy())
    pool.close()
    return data


def attach_cuda_and_checksum(spec_dict: dict, name: str) -> list[float]:
    spec = KVCacheSpec.from_dict(spec_dict)
    cache = DeviceCache.attach(spec, name)
    sums = [float(t.float().sum()) for row in cache.tensors for t in row]
    cache.close()
    return sums
