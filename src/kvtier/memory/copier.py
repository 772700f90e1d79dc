"""BlockCopier: batched device <-> host block copies of every layer and part in one call."""

from __future__ import annotations

import ctypes
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvtier.errors import InvalidBlockIds, LayoutMismatch
from kvtier.layout.block_ids import as_block_ids, check_block_ids, check_same_length
from kvtier.memory.device import DeviceCache
from kvtier.memory.host import HostPool

log = logging.getLogger(__name__)

_copy: Any = None
try:
    from kvtier import _copy  # type: ignore[no-redef]
except ImportError:  # built without a C compiler: the torch path below still works
    pass

BlockIds = Sequence[int] | np.ndarray | torch.Tensor

# Below this many bytes a second copy thread costs more (thread start ~20 us) than it saves.
PARALLEL_MIN_BYTES = 4 << 20
# Staging bound for the two-pass paths (torch fallback on CPU, the device side on CUDA).
STAGING_BYTES = 256 << 20


class BlockCopier(ABC):
    """Moves whole blocks (all layers and parts, extra layers too) between device and host.

    Contract, for every implementation:
    - ``swap_out(device_block_ids, host_block_ids)`` copies device block ``d[i]`` into host block
      ``h[i]`` for every i; ``swap_in(host_block_ids, device_block_ids)`` the reverse.
    - Ids are validated before any byte moves: equal lengths, every id in range, no duplicate
      destination id. Violations raise ``InvalidBlockIds`` naming the offending id. An empty
      list is a no-op.
    - The call returns the number of bytes moved once the bytes are in place (on CUDA, after the
      copy stream is synchronized).
    - ``swap_out(..., checksum=True)`` also records each host block's XXH3-64 in the host pool
      (fused into the copy on the native CPU path); without it the pool forgets those blocks'
      checksums. ``swap_in_verified`` returns, per pair, whether the host block's bytes matched
      the checksum the pool holds for it (False when none is known), and copies exactly the
      pairs that matched: a block that fails verification never reaches the device.
    - A detached device cache raises ``DeviceCacheDetached``.
    - Thread-safe: a swap_out and a swap_in may run at once from two threads, provided they
      do not write the same blocks (the worker's per-direction executors guarantee that).
    """

    def __init__(self, device_cache: DeviceCache, host_pool: HostPool) -> None:
        if device_cache.spec.fingerprint != host_pool.spec.fingerprint:
            raise LayoutMismatch("device cache and host pool were built for different specs")
        self.device_cache = device_cache
        self.host_pool = host_pool
        self.spec = device_cache.spec

    def swap_out(
        self,
        device_block_ids: BlockIds,
        host_block_ids: BlockIds,
        *,
        checksum: bool = False,
        host_limit: int | None = None,
    ) -> int:
        dev, host = self._validate(device_block_ids, host_block_ids, True, host_limit)
        if dev.size == 0:
            return 0
        moved, hashes = self._swap_out(dev, host, checksum)
        if checksum:
            if hashes is None:
                hashes = self.host_pool.compute_checksums(host)
            self.host_pool.set_checksums(host, hashes)
        else:
            self.host_pool.forget_checksums(host)
        return moved

    def swap_in(
        self, host_block_ids: BlockIds, device_block_ids: BlockIds, host_limit: int | None = None
    ) -> int:
        dev, host = self._validate(device_block_ids, host_block_ids, False, host_limit)
        if dev.size == 0:
            return 0
        return self._swap_in(host, dev, False)[0]

    def swap_in_verified(self, host_block_ids: BlockIds, device_block_ids: BlockIds) -> np.ndarray:
        """Copy the pairs whose host block matches its recorded checksum; return which did."""
        dev, host = self._validate(device_block_ids, host_block_ids, False)
        if dev.size == 0:
            return np.zeros(0, dtype=bool)
        expected, known = self.host_pool.expected_checksums(host)
        return self._swap_in_verified(host, dev, expected, known.copy())

    def _swap_in_verified(
        self, host: np.ndarray, dev: np.ndarray, expected: np.ndarray, ok: np.ndarray
    ) -> np.ndarray:
        """Default: hash first (one pass over the host blocks), then copy only the good ones."""
        ok &= self.host_pool.compute_checksums(host) == expected
        if ok.any():
            self._swap_in(host[ok], dev[ok], False)
        return ok

    # ---- direct access to device blocks (CPU caches only) -----------------------------------

    @property
    def direct_device_access(self) -> bool:
        """Whether device blocks are host memory that I/O can read into directly (CPU)."""
        return self.device_cache.device.type == "cpu"

    def device_pieces(
        self, device_block_ids: BlockIds, *, writable: bool = True
    ) -> list[list[memoryview]]:
        """Per block, views of its (layer, part) pieces in page-first order: the stored
        object's payload, scattered over the device tensors. CPU caches only. Destinations
        (``writable``) must not repeat a block."""
        if not self.direct_device_access:
            raise InvalidBlockIds("device blocks of a CUDA cache are not host memory")
        dev = as_block_ids(device_block_ids, "device_block_ids")
        self.check_device_ids(dev, destination=writable)
        base, stride, size = self.device_cache.piece_table()
        addresses = base[None, :] + dev[:, None] * stride[None, :]
        sizes = size.tolist()
        return [
            [_memoryview_at(int(a), n) for a, n in zip(row, sizes)] for row in addresses.tolist()
        ]

    def check_device_ids(self, dev: np.ndarray, *, destination: bool) -> None:
        """Range-check device ids (and, for a destination, refuse duplicates)."""
        self.device_cache.tensors  # noqa: B018 - raises DeviceCacheDetached while asleep
        limit = self.spec.usable_num_blocks
        check_block_ids(dev, limit, "device block id", destination=destination)

    @abstractmethod
    def _swap_out(
        self, dev: np.ndarray, host: np.ndarray, checksum: bool
    ) -> tuple[int, np.ndarray | None]:
        """Copy; return bytes moved and, if asked and fused, the host blocks' hashes."""

    @abstractmethod
    def _swap_in(
        self, host: np.ndarray, dev: np.ndarray, checksum: bool
    ) -> tuple[int, np.ndarray | None]:
        """Copy; return bytes moved and, if asked and fused, the host blocks' hashes."""

    def close(self) -> None:
        """Release staging buffers and streams."""

    def _validate(
        self,
        device_block_ids: BlockIds,
        host_block_ids: BlockIds,
        dst_is_host: bool,
        host_limit: int | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The ids as arrays, each checked once: lengths, ranges (host ids below
        ``host_limit``, default the whole pool), no destination named twice."""
        dev = as_block_ids(device_block_ids, "device_block_ids")
        host = as_block_ids(host_block_ids, "host_block_ids")
        check_same_length(dev, host, "device_block_ids", "host_block_ids")
        self.check_device_ids(dev, destination=not dst_is_host)
        limit = self.host_pool.num_blocks if host_limit is None else host_limit
        check_block_ids(host, limit, "host block id", destination=dst_is_host)
        return dev, host


def _memoryview_at(address: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


class CpuBlockCopier(BlockCopier):
    """One pass per call: a native copy of every (block, layer, part) piece, GIL released.

    The gather from per-layer device tensors and the scatter into page-first host blocks are
    the same memcpy, split by bytes over ``num_threads`` threads. Pointers are computed with
    vectorized numpy from the device cache's piece table; ids were validated first.
    """

    def __init__(
        self, device_cache: DeviceCache, host_pool: HostPool, num_threads: int | None = None
    ):
        super().__init__(device_cache, host_pool)
        if _copy is None:
            raise RuntimeError("kvtier._copy is not built; use TorchBlockCopier")
        self.num_threads: int = num_threads or max(1, torch.get_num_threads())
        # Where each (layer, part) piece of host block 0 lies.
        self._host_pieces: np.ndarray = host_pool.block_address(0) + np.array(
            [p.offset_bytes for p in self.spec.pieces], dtype=np.int64
        )

    def _pointers(
        self, dev: np.ndarray, host: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        base, stride, size = self.device_cache.piece_table()
        if dev.size == 1:  # the common small swap: no broadcasting needed
            return (
                base + int(dev[0]) * stride,
                self._host_pieces + int(host[0]) * self.host_pool.stride_bytes,
                size,
            )
        # Block-major order: consecutive pieces of one host block are adjacent in memory.
        dev_ptrs = dev[:, None] * stride + base
        host_ptrs = host[:, None] * self.host_pool.stride_bytes + self._host_pieces
        return dev_ptrs.ravel(), host_ptrs.ravel(), np.tile(size, dev.size)

    def _run(
        self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, num_blocks: int, checksum: bool
    ) -> tuple[int, np.ndarray | None]:
        total = num_blocks * self.spec.block_bytes
        threads = self.num_threads if total >= PARALLEL_MIN_BYTES else 1
        if not checksum:
            return int(_copy.copy_pieces(dst, src, sizes, threads)), None
        # Hash the *source* pieces in page-first order as they are copied (still in cache).
        hashes = np.empty(num_blocks, dtype=np.uint64)
        _copy.copy_blocks_hashed(dst, src, sizes, len(self.spec.pieces), hashes, threads)
        return total, hashes

    def _swap_out(self, dev, host, checksum):
        dev_ptrs, host_ptrs, sizes = self._pointers(dev, host)
        return self._run(host_ptrs, dev_ptrs, sizes, dev.size, checksum)

    def _swap_in(self, host, dev, checksum):
        dev_ptrs, host_ptrs, sizes = self._pointers(dev, host)
        return self._run(dev_ptrs, host_ptrs, sizes, dev.size, checksum)

    def _swap_in_verified(self, host, dev, expected, ok):
        """One native call: each block is hashed, then copied only if it matched."""
        dev_ptrs, host_ptrs, sizes = self._pointers(dev, host)
        flags = ok.astype(np.uint8)
        total = dev.size * self.spec.block_bytes
        threads = self.num_threads if total >= PARALLEL_MIN_BYTES else 1
        expected = np.ascontiguousarray(expected, dtype=np.uint64)
        _copy.copy_blocks_verified(
            dev_ptrs, host_ptrs, sizes, len(self.spec.pieces), expected, flags, threads
        )
        return flags.astype(bool)


class _StagedCopier(BlockCopier):
    """Two passes through a bounded page-first staging buffer, chunk by chunk.

    Used on CUDA (staging on the device: gather there, then large DMAs to the pinned pool) and as
    the CPU fallback when the native copier is not built. One lock serializes use of the
    staging buffer.
    """

    def __init__(
        self, device_cache: DeviceCache, host_pool: HostPool, staging_device: torch.device
    ):
        super().__init__(device_cache, host_pool)
        self.chunk_blocks = max(
            1, min(STAGING_BYTES // self.spec.block_bytes, host_pool.num_blocks)
        )
        self.staging = torch.zeros(
            (self.chunk_blocks, self.spec.block_bytes), dtype=torch.uint8, device=staging_device
        )
        self._lock = threading.Lock()

    def _staging_views(self, k: int) -> list[torch.Tensor]:
        """Per (layer, part): a typed [k, ...] strided view of the first k staging blocks."""
        views = []
        for p in self.spec.pieces:
            raw = self.staging[:k, p.offset_bytes : p.offset_bytes + p.size_bytes]
            shape = self.spec.part_shape(p.part, k)
            views.append(raw.view(self.spec.torch_dtype(p.part)).view(shape))
        return views

    def _device_tensors(self) -> list[torch.Tensor]:
        return [t for row in self.device_cache.tensors for t in row]

    def _chunks(self, dev: np.ndarray, host: np.ndarray):
        order = np.argsort(host, kind="stable")  # host runs become contiguous staging rows
        dev, host = dev[order], host[order]
        for start in range(0, dev.size, self.chunk_blocks):
            yield dev[start : start + self.chunk_blocks], host[start : start + self.chunk_blocks]

    def _swap_out(self, dev, host, checksum):
        with self._lock:
            tensors = self._device_tensors()
            for d, h in self._chunks(dev, host):
                idx = torch.from_numpy(d).to(self.staging.device, non_blocking=True)
                for src, out in zip(tensors, self._staging_views(d.size)):
                    torch.index_select(src, 0, idx, out=out)
                self._staging_to_host(h)
            self._finish()
        return dev.size * self.spec.block_bytes, None

    def _swap_in(self, host, dev, checksum):
        with self._lock:
            tensors = self._device_tensors()
            for d, h in self._chunks(dev, host):
                self._host_to_staging(h)
                idx = torch.from_numpy(d).to(self.staging.device, non_blocking=True)
                for dst, view in zip(tensors, self._staging_views(d.size)):
                    dst.index_copy_(0, idx, view)
            self._finish()
        return dev.size * self.spec.block_bytes, None

    def _staging_to_host(self, host: np.ndarray) -> None:
        slab = self.host_pool.slab
        for i, h0, n in _runs(host):
            slab[h0 : h0 + n].copy_(self.staging[i : i + n], non_blocking=True)

    def _host_to_staging(self, host: np.ndarray) -> None:
        slab = self.host_pool.slab
        for i, h0, n in _runs(host):
            self.staging[i : i + n].copy_(slab[h0 : h0 + n], non_blocking=True)

    def _finish(self) -> None:
        """Bytes are in place when this returns."""

    def close(self) -> None:
        self.staging = self.staging[:0]


def _runs(sorted_ids: np.ndarray):
    """(position, first id, length) of each run of consecutive ids in a sorted array."""
    if sorted_ids.size == 0:
        return
    breaks = np.flatnonzero(np.diff(sorted_ids) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [sorted_ids.size]))
    for s, e in zip(starts.tolist(), ends.tolist()):
        yield s, int(sorted_ids[s]), e - s


class TorchBlockCopier(_StagedCopier):
    """CPU fallback: index_select into host-side staging, then runs of host blocks (two passes)."""

    def __init__(self, device_cache: DeviceCache, host_pool: HostPool):
        super().__init__(device_cache, host_pool, torch.device("cpu"))


class CudaBlockCopier(_StagedCopier):
    """CUDA: gather on the device into bounded staging, then large DMAs to the pinned pool.

    All work runs on one dedicated stream; ``_finish`` synchronizes it, so a returned call means
    the bytes are in place. Host blocks are sorted so that runs of consecutive host ids travel in
    one DMA each.
    """

    def __init__(self, device_cache: DeviceCache, host_pool: HostPool):
        if not host_pool.pinned:
            log.warning(
                "host pool is not pinned: device<->host copies will be slow and synchronous"
            )
        super().__init__(device_cache, host_pool, device_cache.device)
        self.stream = torch.cuda.Stream(device=device_cache.device)

    def _swap_out(self, dev, host, checksum):
        with torch.cuda.stream(self.stream):
            return super()._swap_out(dev, host, checksum)

    def _swap_in(self, host, dev, checksum):
        with torch.cuda.stream(self.stream):
            return super()._swap_in(host, dev, checksum)

    def _finish(self) -> None:
        self.stream.synchronize()


_warned_fallback = False
NO_NATIVE_COPIER = (
    "kvtier._copy is not built (no C compiler at install time): using the two-pass torch "
    "copier, about half as fast; reinstall with a compiler for the native one"
)


def native_copier_missing() -> str | None:
    """What to tell the user when the native CPU copier is not built (None when it is)."""
    return NO_NATIVE_COPIER if _copy is None else None


def _warn_no_native_copier() -> None:
    global _warned_fallback
    if not _warned_fallback:
        _warned_fallback = True
        log.warning(NO_NATIVE_COPIER)


def make_copier(
    device_cache: DeviceCache, host_pool: HostPool, num_threads: int | None = None
) -> BlockCopier:
    """The fastest copier for this device cache: native CPU, CUDA, or the torch fallback."""
    if device_cache.device.type == "cuda":
        return CudaBlockCopier(device_cache, host_pool)
    if _copy is None:
        _warn_no_native_copier()
        return TorchBlockCopier(device_cache, host_pool)
    return CpuBlockCopier(device_cache, host_pool, num_threads)
