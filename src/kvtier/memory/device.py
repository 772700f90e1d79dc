"""DeviceCache: the engine's per-layer K/V/scale tensors, created, attached by name, or wrapped.

Three ways to get one:

- ``DeviceCache.create(spec, name)`` — the owner allocates the cache and publishes it under
  ``name``: on CPU one named shared-memory file (a JSON header page, then the tensors, placed by
  a ``SegmentLayout``: page-aligned by default, or the engine's own placement, e.g. every layer
  ``layer_stride`` apart in one buffer); on CUDA dedicated allocations whose IPC handles are
  published in a small file (``kvtier.memory.cuda_ipc``).
- ``DeviceCache.attach(spec, name)`` — a peer process maps the published cache; the layout in the
  header must equal ``spec`` field by field, otherwise ``LayoutMismatch`` names the fields.
- ``DeviceCache.wrap(spec, key_caches, value_caches, ...)`` — in process, tensors the engine
  already has (torch tensors or anything with ``__dlpack__``). ``publish(name)`` shares wrapped
  CUDA tensors with a worker.

Published files follow ``kvtier.memory.shm``: created locked (a file whose lock can be taken
belongs to a dead owner: ``create`` reclaims it, ``attach`` refuses it), opened without following
links and checked on the descriptor (regular, ours, 0600), mapped from that descriptor
(``kvtier.memory.published``).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvtier.errors import ConfigError, DeviceCacheDetached, DeviceCacheError, LayoutMismatch
from kvtier.layout.spec import KVCacheSpec, Part
from kvtier.memory import shm
from kvtier.memory.published import attach_path, check_tensor, find_published, write_cuda_handles
from kvtier.memory.segment import (
    HEADER_BYTES,
    SegmentLayout,
    create_cpu,
)
from kvtier.memory.shm import SegmentKind

log = logging.getLogger(__name__)


class CacheMode(str, Enum):
    OWNER = "owner"
    ATTACHED = "attached"
    WRAPPED = "wrapped"


def require_device(device: str, field: str) -> None:
    """Refuse (``ConfigError`` naming ``field``) a CUDA device this torch cannot use: a CPU-only
    build, or an index past the devices there are."""
    if not str(device).startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            field,
            f"{device} asked for, but this torch ({torch.__version__}) has no CUDA device: "
            "use cpu, or install a CUDA build of torch on a machine with a GPU",
        )
    index = int(str(device).partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(
            field, f"{device} asked for, but there are {torch.cuda.device_count()} CUDA devices"
        )


def cache_name(instance_id: str, rank: int, device_index: int = 0) -> str:
    """The published name of one rank's device cache: the instance id keeps engines apart."""
    name = f"kvtier-{instance_id}-rank{rank}-dev{device_index}"
    shm.check_name(name)
    return name


def _as_torch(t: Any, what: str) -> torch.Tensor:
    if isinstance(t, torch.Tensor):
        return t
    if hasattr(t, "__dlpack__"):
        return torch.from_dlpack(t)
    raise LayoutMismatch(f"{what} is a {type(t).__name__}: need a torch tensor or a DLPack tensor")


class DeviceCache:
    """Per-layer device tensors of one rank, addressed as ``tensor(layer, part)``.

    Not thread-safe for detach/attach against concurrent copies: the worker's control path
    stops data tasks before it sleeps or wakes.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        tensors: list[list[torch.Tensor]],
        *,
        mode: CacheMode,
        name: str | None = None,
        lock_fd: int | None = None,
        segment: torch.Tensor | None = None,
    ) -> None:
        self.spec = spec
        self.mode = mode
        self.name = name
        self._tensors: list[list[torch.Tensor]] | None = tensors
        self._lock_fd = lock_fd
        self._segment = segment  # keeps the CPU mapping alive
        self._published_path: Path | None = None
        self.generation = 0  # bumped on every detach/attach so users can drop cached pointers
        self._piece_table: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._piece_spans: list[memoryview] | None = None
        self.device = tensors[0][0].device

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        spec: KVCacheSpec,
        name: str,
        device: str | torch.device = "cpu",
        layout: SegmentLayout | None = None,
    ) -> DeviceCache:
        """Allocate the cache, zero it, and publish it under ``name`` (this process owns it).

        ``layout`` places the tensors inside a CPU segment (default: ``SegmentLayout.packed``).
        """
        dev = torch.device(device)
        if dev.type not in ("cpu", "cuda"):
            raise DeviceCacheError(f"device type {dev.type!r} not supported: use cpu or cuda")
        shm.reclaim_orphans()
        kind = SegmentKind.CPU_CACHE if dev.type == "cpu" else SegmentKind.CUDA_HANDLES
        path = shm.segment_path(name, kind)
        fd = shm.create_locked(path, f"device cache {name!r}")
        try:
            if dev.type == "cpu":
                tensors, segment = create_cpu(spec, fd, layout or SegmentLayout.packed(spec))
            else:
                tensors = [
                    [
                        torch.zeros(
                            spec.part_shape(p, spec.layer_num_blocks(layer)),
                            dtype=spec.torch_dtype(p),
                            device=dev,
                        )
                        for p in spec.parts
                    ]
                    for layer in range(spec.total_layers)
                ]
                segment = None
                write_cuda_handles(fd, spec, tensors)
        except BaseException:
            shm.unlink_quietly(path)
            os.close(fd)
            raise
        cache = cls(spec, tensors, mode=CacheMode.OWNER, name=name, lock_fd=fd, segment=segment)
        cache._published_path = path
        log.info("created device cache %s (%s, %d bytes)", name, dev, spec.device_bytes)
        return cache

    @classmethod
    def attach(cls, spec: KVCacheSpec, name: str, device_type: str | None = None) -> DeviceCache:
        """Map a cache that another process created or published under ``name``."""
        path = find_published(name, device_type)
        tensors, segment = attach_path(spec, name, path)
        cache = cls(spec, tensors, mode=CacheMode.ATTACHED, name=name, segment=segment)
        log.info("attached device cache %s (%s)", name, cache.device)
        return cache

    @classmethod
    def wrap(
        cls,
        spec: KVCacheSpec,
        key_caches: Sequence[Any],
        value_caches: Sequence[Any] | None = None,
        key_scales: Sequence[Any] | None = None,
        value_scales: Sequence[Any] | None = None,
    ) -> DeviceCache:
        """Use tensors the engine already has: one list entry per layer (main, then extra).

        With a fused K|V spec (``kv_layout="fused"``), ``key_caches`` holds the fused tensors.
        """
        given = {
            Part.KEY: key_caches,
            Part.KEY_VALUE: key_caches,
            Part.VALUE: value_caches,
            Part.KEY_SCALE: key_scales,
            Part.VALUE_SCALE: value_scales,
        }
        for part, seq in given.items():
            if part not in spec.parts and seq and part not in (Part.KEY, Part.KEY_VALUE):
                raise LayoutMismatch(f"{part.value} tensors given but the spec has no {part.value}")
            if part in spec.parts and (seq is None or len(seq) != spec.total_layers):
                got = "none" if seq is None else str(len(seq))
                raise LayoutMismatch(
                    f"{part.value}: need {spec.total_layers} tensors (one per layer), got {got}"
                )
        tensors: list[list[torch.Tensor]] = []
        for layer in range(spec.total_layers):
            row = []
            for part in spec.parts:
                t = _as_torch(given[part][layer], f"layer {layer} {part.value}")  # type: ignore[index]
                check_tensor(spec, layer, part, t)
                row.append(t)
            tensors.append(row)
        devices = {t.device for row in tensors for t in row}
        if len(devices) != 1:
            raise LayoutMismatch(
                f"all tensors must be on one device, got {sorted(map(str, devices))}"
            )
        return cls(spec, tensors, mode=CacheMode.WRAPPED)

    def publish(self, name: str) -> None:
        """Publish wrapped CUDA tensors so a worker can ``attach`` them by ``name``."""
        if self.mode is not CacheMode.WRAPPED or self.device.type != "cuda":
            raise DeviceCacheError(
                "publish() shares wrapped CUDA tensors; on CPU create the cache with "
                "DeviceCache.create so it lives in shared memory"
            )
        path = shm.segment_path(name, SegmentKind.CUDA_HANDLES)
        fd = shm.create_locked(path, f"device cache {name!r}")
        try:
            write_cuda_handles(fd, self.spec, self.tensors)
        except BaseException:
            shm.unlink_quietly(path)
            os.close(fd)
            raise
        self.name, self._lock_fd, self._published_path = name, fd, path

    # ---- access -----------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self._tensors is not None

    @property
    def tensors(self) -> list[list[torch.Tensor]]:
        """``tensors[layer][i]`` is the tensor of ``spec.parts[i]``."""
        if self._tensors is None:
            raise DeviceCacheDetached(f"device cache {self.name or '(wrapped)'} is detached")
        return self._tensors

    @property
    def segment(self) -> torch.Tensor | None:
        """The raw uint8 mapping of a CPU shared-memory cache (header page included), else None."""
        return self._segment

    @property
    def data(self) -> torch.Tensor:
        """The data region of a CPU segment (after the header page), as uint8."""
        if self._segment is None:
            raise DeviceCacheError("only a CPU shared-memory cache has a data region")
        return self._segment[HEADER_BYTES:]

    def tensor(self, layer: int, part: Part) -> torch.Tensor:
        return self.tensors[layer][self.spec.parts.index(part)]

    def piece_table(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per (layer, part) in page-first order: base address, block stride, block bytes."""
        if self._piece_table is None:
            tensors = [t for row in self.tensors for t in row]
            base = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
            stride = np.array([t.stride(0) * t.element_size() for t in tensors], dtype=np.int64)
            size = np.array([p.size_bytes for p in self.spec.pieces], dtype=np.int64)
            self._piece_table = (base, stride, size)
        return self._piece_table

    def piece_spans(self) -> list[memoryview]:
        """Per (layer, part), as ``piece_table``: one flat byte view from its block 0 to the
        end of its last block (CPU caches only), to slice each block's piece from."""
        if self._piece_spans is None:
            if self.device.type != "cpu":
                raise DeviceCacheError("only a CPU cache's blocks are host memory")
            base, stride, size = self.piece_table()
            blocks = [t.shape[0] for row in self.tensors for t in row]
            self._piece_spans = [
                _bytes_at(int(b), (k - 1) * int(st) + int(n))
                for b, st, n, k in zip(base, stride, size, blocks)
            ]
        return self._piece_spans

    # ---- lifecycle --------------------------------------------------------------------------

    def detach(self) -> None:
        """Drop this process's mapping (sleep). Views taken earlier keep their memory alive."""
        self._tensors = None
        self._segment = None
        self._piece_table = self._piece_spans = None
        self.generation += 1

    def reattach(self) -> None:
        """Map the published cache again (wakeup), checking the layout against the spec."""
        if self._tensors is not None:
            return
        if self.mode is CacheMode.WRAPPED and self._published_path is None:
            raise DeviceCacheError(
                "a wrapped cache cannot re-attach: wrap the engine's tensors again"
            )
        if self.name is None:
            raise DeviceCacheError("an unnamed cache cannot re-attach")
        path = self._published_path or find_published(self.name, self.device.type)
        self._tensors, self._segment = attach_path(
            self.spec, self.name, path, check_owner=self._lock_fd is None
        )
        self._piece_table = self._piece_spans = None
        self.generation += 1

    def close(self) -> None:
        """Detach; the owner (or publisher) also unlinks its name."""
        self.detach()
        if self._lock_fd is not None:
            if self._published_path is not None:
                shm.unlink_quietly(self._published_path)
            os.close(self._lock_fd)
            self._lock_fd = None
            log.info("closed device cache %s and unlinked it", self.name)

    def __enter__(self) -> DeviceCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "attached" if self.attached else "detached"
        return f"DeviceCache({self.name or '(wrapped)'}, {self.mode.value}, {self.device}, {state})"


def _bytes_at(address: int, size: int) -> memoryview:
    """A writable byte view of memory this process maps (it does not keep the mapping alive)."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")
