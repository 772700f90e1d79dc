"""BlockCopier: the contract of a batched device <-> host copier — ids checked once, host
checksums kept right, verified swap-ins, and direct access to a CPU cache's block pieces. The
copiers themselves (native, torch, CUDA) are in ``kvtier.memory.copier``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch

from kvtier.errors import InvalidBlockIds, LayoutMismatch
from kvtier.layout.block_ids import as_block_ids, check_block_ids, check_same_length
from kvtier.memory.device import DeviceCache
from kvtier.memory.host import HostPool

BlockIds = Sequence[int] | np.ndarray | torch.Tensor


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
        checked: bool = False,
    ) -> int:
        """Device blocks -> host blocks (pairwise). ``checked``: the caller passes arrays it has
        range-checked against this copier already (a worker's route, ids checked once per
        task)."""
        dev, host = self._validate(device_block_ids, host_block_ids, True, host_limit, checked)
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
        self,
        host_block_ids: BlockIds,
        device_block_ids: BlockIds,
        host_limit: int | None = None,
        *,
        checked: bool = False,
    ) -> int:
        """Host blocks -> device blocks (pairwise); ``checked``: as for ``swap_out``."""
        dev, host = self._validate(device_block_ids, host_block_ids, False, host_limit, checked)
        if dev.size == 0:
            return 0
        return self._swap_in(host, dev, False)[0]

    def swap_in_verified(
        self, host_block_ids: BlockIds, device_block_ids: BlockIds, *, checked: bool = False
    ) -> np.ndarray:
        """Copy the pairs whose host block matches its recorded checksum; return which did."""
        dev, host = self._validate(device_block_ids, host_block_ids, False, checked=checked)
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
        self, device_block_ids: BlockIds, *, writable: bool = True, checked: bool = False
    ) -> list[list[memoryview]]:
        """Per block, views of its (layer, part) pieces in page-first order: the stored
        object's payload, scattered over the device tensors. CPU caches only. Destinations
        (``writable``) must not repeat a block."""
        if not self.direct_device_access:
            raise InvalidBlockIds("device blocks of a CUDA cache are not host memory")
        dev = as_block_ids(device_block_ids, "device_block_ids")
        if not checked:
            self.check_device_ids(dev, destination=writable)
        _, stride, size = self.device_cache.piece_table()
        spans, sizes = self.device_cache.piece_spans(), size.tolist()
        return [
            [span[o : o + n] for span, o, n in zip(spans, row, sizes)]
            for row in (dev[:, None] * stride[None, :]).tolist()
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
        checked: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The ids as arrays, each checked once: lengths, ranges (host ids below
        ``host_limit``, default the whole pool), no destination named twice. ``checked``: the
        caller did that already."""
        dev = as_block_ids(device_block_ids, "device_block_ids")
        host = as_block_ids(host_block_ids, "host_block_ids")
        if checked:
            return dev, host
        check_same_length(dev, host, "device_block_ids", "host_block_ids")
        self.check_device_ids(dev, destination=not dst_is_host)
        limit = self.host_pool.num_blocks if host_limit is None else host_limit
        check_block_ids(host, limit, "host block id", destination=dst_is_host)
        return dev, host
