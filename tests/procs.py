"""Functions run in child processes (spawned) by the multi-process tests."""

from __future__ import annotations

import os
import signal

import torch

from kvtier.layout.spec import KVCacheSpec
from kvtier.memory.copier import make_copier
from kvtier.memory.device import DeviceCache
from kvtier.memory.host import HostPool


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


def attach_cuda_and_checksum(spec_dict: dict, name: str) -> list[float]:
    spec = KVCacheSpec.from_dict(spec_dict)
    cache = DeviceCache.attach(spec, name)
    sums = [float(t.float().sum()) for row in cache.tensors for t in row]
    cache.close()
    return sums


def client_through_a_stall(endpoints: list[str], ready, go, results) -> None:
    """A client that is stopped (SIGSTOP by the test) between two tasks: ``results`` gets the
    second task's status, or its error, and every 'lost' line this client logged."""
    import logging

    from kvtier.engine.client import Client
    from kvtier.transport import tasks as t

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("kvtier").addHandler(Keep())
    with Client.connect(endpoints, worker_timeout_s=2.5, heartbeat_interval_s=0.1) as client:
        assert client.swap_out([1], [0]).status is t.Status.OK
        ready.set()
        go.wait(120)
        try:
            outcome = client.swap_out([2], [1]).status.value
        except Exception as e:  # reported to the test, which names it
            outcome = f"{type(e).__name__}: {e}"
    results.put((outcome, [line for line in lines if "lost" in line]))
