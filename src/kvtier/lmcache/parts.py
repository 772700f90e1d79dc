"""What the LMCache adapter reads and writes besides its tasks: its settings
(``adapter_params``), the key context LMCache keeps outside its hash, and the objects' bytes
(slices of LMCache's L1 arena, or each object's own tensor)."""

from __future__ import annotations

import ctypes
import logging
import struct
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from kvtier.errors import ConfigError
from kvtier.hosted.settings import HostedSettings
from kvtier.hosted.shelf import as_block

if TYPE_CHECKING:
    from lmcache.v1.distributed.api import ObjectKey
    from lmcache.v1.distributed.internal_api import L1MemoryDesc
    from lmcache.v1.memory_management import MemoryObj

log = logging.getLogger("kvtier.lmcache")

DEFAULT_NAMESPACE = "lmcache"
MAX_WORKERS = 64
# Slices of the L1 arena kept (``L1View``): ~150 bytes each.
MAX_SLICES = 1 << 16


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
    slice. LMCache's objects sit at fixed places in the arena, so each place's slice is kept:
    slicing costs ~2 us a block, a task of 32 objects 60 us of a 3 ms load."""

    def __init__(self, desc: L1MemoryDesc) -> None:
        self.base, self.size = desc.ptr, desc.size
        arena = (ctypes.c_ubyte * desc.size).from_address(desc.ptr)
        self.flat = torch.frombuffer(arena, dtype=torch.uint8)
        self.bytes = memoryview(arena).cast("B")
        self._slices: dict[tuple[int, int], torch.Tensor] = {}

    def view(self, address: int, nbytes: int) -> memoryview | None:
        """The bytes at ``address`` as a memoryview slice (cheaper than a tensor: made each
        time), or None where they are not all in the arena."""
        at = address - self.base
        if at < 0 or at + nbytes > self.size:
            return None
        return self.bytes[at : at + nbytes]

    def block(self, address: int, nbytes: int) -> torch.Tensor | None:
        block = self._slices.get((address, nbytes))
        if block is not None:
            return block
        at = address - self.base
        if at < 0 or at + nbytes > self.size:
            return None
        if len(self._slices) >= MAX_SLICES:  # places of many sizes: start again
            self._slices.clear()
        block = self._slices[(address, nbytes)] = self.flat[at : at + nbytes]
        return block


def object_block(obj: MemoryObj, l1: L1View | None = None) -> torch.Tensor:
    """The object's bytes as a flat uint8 tensor, without a copy: a slice of LMCache's L1
    arena where it lies in it (``l1``: one slice), else its own tensor where it has a plain
    CPU one (LMCache's ``byte_array`` builds a ctypes array on every call)."""
    if l1 is not None:
        block = l1.block(obj.data_ptr, obj.get_size())
        if block is not None:
            return block
    raw = obj.raw_tensor
    size = obj.get_size()
    if isinstance(raw, torch.Tensor) and raw.is_contiguous() and raw.device.type == "cpu":
        flat = raw.view(torch.uint8).reshape(-1)
        if flat.numel() >= size:
            return flat[:size]
    return as_block(obj.byte_array)


def object_buffers(
    objects: Sequence[MemoryObj], size: int, l1: L1View | None
) -> list[memoryview] | None:
    """Each object's bytes (``object_block``'s) as a memoryview, for the store's started
    transfers; None if one is not ``size`` bytes."""
    buffers = []
    for obj in objects:
        if obj.get_size() != size:
            return None
        view = l1.view(obj.data_ptr, size) if l1 is not None else None
        buffers.append(view if view is not None else object_block(obj).numpy().data)
    return buffers


def by_size(objects: Sequence[MemoryObj]) -> dict[int, list[int]]:
    """Indices of ``objects`` by their size in bytes (almost always one size)."""
    groups: dict[int, list[int]] = {}
    for i, obj in enumerate(objects):
        groups.setdefault(obj.get_size(), []).append(i)
    return groups


class StoredObjects:
    """What the adapter stored (storage key -> LMCache key and size), for LMCache's byte
    accounting per ``cache_salt``: added as puts succeed, taken out as kvtier's tiers evict
    (the backend's listener queues them, possibly under its locks; a task reports them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stored: dict[str, tuple[ObjectKey, int]] = {}
        self._evicted: list[str] = []

    def fresh(self, storage_keys: Sequence[str]) -> list[int]:
        """Which keys to write: what was stored is not written again (nor counted twice)."""
        with self._lock:
            return [j for j, key in enumerate(storage_keys) if key not in self._stored]

    def add(self, storage_keys: Sequence[str], keys: Sequence[ObjectKey], size: int) -> None:
        with self._lock:
            for storage_key, key in zip(storage_keys, keys, strict=True):
                self._stored[storage_key] = (key, size)

    def evicted(self, storage_keys: list[str]) -> None:
        """The backend's removal listener (``watch_removals``): queued, never blocks."""
        with self._lock:
            self._evicted.extend(storage_keys)

    def take_evicted(self) -> list[tuple[ObjectKey, int]]:
        """The stored objects evicted since the last call: their LMCache keys and sizes."""
        if not self._evicted:  # almost always (a read of a list: no lock taken for it)
            return []
        with self._lock:
            evicted, self._evicted = self._evicted, []
            return [self._stored.pop(k) for k in evicted if k in self._stored]


def bitmap_of(n: int, found: list[int]) -> Bitmap:
    """LMCache's bitmap of ``n`` keys with the ``found`` ones set (one call for a leading run,
    as a load almost always is)."""
    bitmap = Bitmap(n)
    found.sort()
    if found and found[-1] == len(found) - 1:
        bitmap.set_range(0, len(found))
    else:
        for i in found:
            bitmap.set(i)
    return bitmap


class TaskThreads:
    """Threads running the adapter's tasks, in the order submitted. Each task answers through
    its own event fd, so there are no futures: a submit hands the task to the thread that went
    idle last, or queues it while all are busy. A task about to signal its answer puts its
    thread on the idle stack first (``answering``), so a caller that submits its next task at
    once gets that thread, its caches warm, not a cold one woken on the other core. (Measured
    on 2 cores: a submit 17-26 us against 37-43 with a ``ThreadPoolExecutor``; back-to-back
    loads with one thread 0.98-1.13x the store alone against 1.03-1.09x with four: within the
    noise.)"""

    def __init__(self, count: int, name: str) -> None:
        self._lock = threading.Lock()
        self._pending: deque[tuple[Callable[..., None], tuple]] = deque()
        self._idle: list[_Slot] = []  # a stack: the last to go idle is handed the next task
        self._stopping = False
        self._local = threading.local()
        self._threads = [
            threading.Thread(target=self._run, args=(_Slot(),), name=f"{name}-{i}", daemon=True)
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, run: Callable[..., None], *args: object) -> None:
        with self._lock:
            if self._stopping:
                raise RuntimeError("the adapter's task threads are stopped")
            if not self._idle:
                self._pending.append((run, args))
                return
            slot = self._idle.pop()
            slot.listed, slot.task = False, (run, args)
        slot.wake.release()

    def answering(self) -> None:
        """Called by a task just before it signals its answer (its remaining steps are short):
        its thread is handed the next task submitted, if none is queued."""
        slot = getattr(self._local, "slot", None)
        if slot is None:
            return
        with self._lock:
            if not (self._pending or self._stopping or slot.listed or slot.task):
                slot.listed = True
                self._idle.append(slot)

    def shutdown(self) -> None:
        """Drop the tasks not begun, wait for those running."""
        with self._lock:
            self._stopping = True
            self._pending.clear()
            idle, self._idle = self._idle, []
            for slot in idle:
                slot.listed = False
        for slot in idle:
            slot.wake.release()  # with no task: the thread ends
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join()

    def _run(self, slot: _Slot) -> None:
        self._local.slot = slot
        while True:
            task = None
            with self._lock:
                # Listed by ``answering``, or handed a task since: its wake is (to be) released.
                waiting = slot.listed or slot.task is not None
                if not waiting:
                    task = self._pending.popleft() if self._pending else None
                    if task is None:
                        if self._stopping:
                            return
                        slot.listed = waiting = True
                        self._idle.append(slot)
            if waiting:
                slot.wake.acquire()  # released by submit (a task) or shutdown (none)
                with self._lock:
                    task, slot.task = slot.task, None
                if task is None:
                    return
            assert task is not None
            run, args = task
            try:
                run(*args)
            except Exception:  # each task answers its own errors; this is a bug: go on
                log.exception("kvtier L2 adapter task failed")


class _Slot:
    """One thread's hand-over: ``task`` set, then ``wake`` released (held while it waits);
    ``listed``: on the idle stack."""

    def __init__(self) -> None:
        self.task: tuple[Callable[..., None], tuple] | None = None
        self.listed = False
        self.wake = threading.Lock()
        self.wake.acquire()
