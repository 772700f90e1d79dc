"""BlockCopier: batched device <-> host block copies of every layer and part in one call."""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np
import torch

from kvtier.memory import stores
from kvtier.memory.copier_base import BlockCopier
from kvtier.memory.device import DeviceCache
from kvtier.memory.host import HostPool

log = logging.getLogger(__name__)

_copy: Any = None
try:
    from kvtier import _copy  # type: ignore[no-redef]
except ImportError:  # built without a C compiler: the torch path below still works
    pass

# Below this many bytes a second copy thread costs more (thread start ~20 us) than it saves.
PARALLEL_MIN_BYTES = 4 << 20
# Staging bound for the two-pass paths (torch fallback on CPU, the device side on CUDA).
STAGING_BYTES = 256 << 20


class CpuBlockCopier(BlockCopier):
    """One pass per call: a native copy of every (block, layer, part) piece.

    The gather from per-layer device tensors and the scatter into page-first host blocks are
    the same memcpy, split by blocks over ``num_threads`` threads (the GIL is released, except
    for a copy under 1 MiB on one thread: microseconds). A plain copy hands the native side each
    side's piece bases, strides and block ids, and it computes the addresses; the checksummed
    copies compute them with vectorized numpy. Ids were validated first.
    """

    def __init__(
        self, device_cache: DeviceCache, host_pool: HostPool, num_threads: int | None = None
    ):
        super().__init__(device_cache, host_pool)
        if _copy is None:
            raise RuntimeError("kvtier._copy is not built; use TorchBlockCopier")
        self.num_threads: int = num_threads or max(1, torch.get_num_threads())
        self._stores = stores.choice(_copy)  # streaming or cached stores: timed on this host
        # Where each (layer, part) piece of host block 0 lies, and each piece's block stride.
        self._host_pieces: np.ndarray = host_pool.block_address(0) + np.array(
            [p.offset_bytes for p in self.spec.pieces], dtype=np.int64
        )
        self._host_strides = np.full(len(self.spec.pieces), host_pool.stride_bytes, np.int64)

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

    def _copy_hashed(
        self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, num_blocks: int
    ) -> tuple[int, np.ndarray]:
        """Copy the pieces and hash each block's *source* pieces in page-first order as they
        are copied (still in cache)."""
        hashes = np.empty(num_blocks, dtype=np.uint64)
        threads = self._threads_for(num_blocks)
        nbytes = num_blocks * self.spec.block_bytes
        pieces = len(self.spec.pieces)
        self._stores.run(
            nbytes, lambda: _copy.copy_blocks_hashed(dst, src, sizes, pieces, hashes, threads)
        )
        return nbytes, hashes

    def _swap_out(self, dev, host, checksum):
        if checksum:
            dev_ptrs, host_ptrs, sizes = self._pointers(dev, host)
            return self._copy_hashed(host_ptrs, dev_ptrs, sizes, dev.size)
        return self._copy_plain(dev, host, to_host=True)

    def _swap_in(self, host, dev, checksum):
        if checksum:
            dev_ptrs, host_ptrs, sizes = self._pointers(dev, host)
            return self._copy_hashed(dev_ptrs, host_ptrs, sizes, dev.size)
        return self._copy_plain(dev, host, to_host=False)

    def _copy_plain(self, dev: np.ndarray, host: np.ndarray, to_host: bool) -> tuple[int, None]:
        """The native side computes each piece's address from (bases, strides, ids): no numpy
        temporaries (microseconds on a 1-block swap, the common small task)."""
        base, stride, size = self.device_cache.piece_table()
        device, host_side = (base, stride, dev), (self._host_pieces, self._host_strides, host)
        dst, src = (host_side, device) if to_host else (device, host_side)
        threads = self._threads_for(dev.size)
        nbytes = dev.size * self.spec.block_bytes
        total = self._stores.run(nbytes, lambda: _copy.copy_indexed(*dst, *src, size, threads))
        return total, None

    def _threads_for(self, num_blocks: int) -> int:
        return self.num_threads if num_blocks * self.spec.block_bytes >= PARALLEL_MIN_BYTES else 1

    def _swap_in_verified(self, host, dev, expected, ok):
        """One native call: each block is hashed, then copied only if it matched."""
        dev_ptrs, host_ptrs, sizes = self._pointers(dev, host)
        flags = ok.astype(np.uint8)
        threads = self._threads_for(dev.size)
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
