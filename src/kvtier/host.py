"""HostPool: one pre-touched, page-first slab of host blocks (pinned when CUDA is present)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import torch

from kvtier.device import SHM_DIR, _check_name, _open_exclusive, _unlink_quietly
from kvtier.errors import ConfigError, DeviceCacheError, InvalidBlockIds
from kvtier.spec import KVCacheSpec, Part

log = logging.getLogger(__name__)


# Each block is preceded by a slot for its storage header, so that [header | block] -- exactly
# one stored object -- is one contiguous range: a single buffer per object for Mooncake and
# file I/O instead of two (measured: two-buffer gets over TCP ran at 0.6-0.8x).
HEADER_SLOT_BYTES = 64


class HostPool:
    """``num_blocks`` host blocks of ``spec.block_bytes`` each, in one slab.

    Page-first: host block i holds layer 0 K, layer 0 V, [layer 0 scales], layer 1 K, ...
    contiguously, so one block is one contiguous range (one storage object, one DMA). Blocks are
    ``stride_bytes`` apart: each is preceded by a ``HEADER_SLOT_BYTES`` slot where storage
    backends build the object header (``object_view``).
    The slab is allocated once and zeroed at construction (first touch of fresh memory runs at
    2-4 GB/s here, warm memory at 13-16), so no transfer ever pays for page faults.

    ``shared_name`` backs the slab with a /dev/shm file another process can map read-only or
    read-write with ``HostPool.open_shared``; the creating pool unlinks it on ``close``.
    Views are safe to use from several threads as long as no two writers touch one block.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        *,
        pin: bool | None = None,
        shared_name: str | None = None,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError("num_host_blocks", f"must be a positive integer, got {num_blocks!r}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_bytes = spec.block_bytes
        self.stride_bytes = HEADER_SLOT_BYTES + spec.block_bytes
        self.size_bytes = num_blocks * self.stride_bytes
        self._lock_fd: int | None = None
        self._path: Path | None = None
        self.pinned = False
        want_pin = torch.cuda.is_available() if pin is None else pin
        if shared_name is not None:
            _check_name(shared_name)
            self._path = SHM_DIR / f"{shared_name}.hostpool"
            self._lock_fd = _open_exclusive(self._path, shared_name)
            os.ftruncate(self._lock_fd, self.size_bytes)
            flat = torch.from_file(
                str(self._path), shared=True, size=self.size_bytes, dtype=torch.uint8
            )
            if want_pin:
                self.pinned = _register_pinned(flat)
        elif want_pin:
            flat = torch.empty(self.size_bytes, dtype=torch.uint8, pin_memory=True)
            self.pinned = True
        else:
            flat = torch.empty(self.size_bytes, dtype=torch.uint8)
        flat.zero_()  # pre-touch: every page faulted in now
        self._set_flat(flat)
        log.info(
            "host pool: %d blocks x %d bytes = %.2f GiB%s%s",
            num_blocks,
            self.block_bytes,
            self.size_bytes / 2**30,
            ", pinned" if self.pinned else "",
            f", shared as {shared_name}" if shared_name else "",
        )

    @classmethod
    def open_shared(cls, spec: KVCacheSpec, shared_name: str, num_blocks: int) -> HostPool:
        """Map a pool another process created with ``shared_name``."""
        _check_name(shared_name)
        path = SHM_DIR / f"{shared_name}.hostpool"
        want = num_blocks * (HEADER_SLOT_BYTES + spec.block_bytes)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise DeviceCacheError(f"no host pool named {shared_name!r} in {SHM_DIR}") from None
        if size != want:
            raise DeviceCacheError(
                f"host pool {shared_name!r} holds {size} bytes; {num_blocks} blocks of this "
                f"spec need {want}"
            )
        pool = cls.__new__(cls)
        pool.spec, pool.num_blocks, pool.block_bytes, pool.size_bytes = (
            spec,
            num_blocks,
            spec.block_bytes,
            want,
        )
        pool.stride_bytes = HEADER_SLOT_BYTES + spec.block_bytes
        pool._lock_fd, pool._path, pool.pinned = None, None, False
        flat = torch.from_file(str(path), shared=True, size=want, dtype=torch.uint8)
        pool._set_flat(flat)
        return pool

    def _set_flat(self, flat: torch.Tensor) -> None:
        self.flat = flat
        # [num_blocks, block_bytes] views of the payloads, and of [header slot | payload].
        self.slab = flat.as_strided(
            (self.num_blocks, self.block_bytes), (self.stride_bytes, 1), HEADER_SLOT_BYTES
        )
        self.objects = flat.view(self.num_blocks, self.stride_bytes)
        self._init_checksums()

    # ---- checksums --------------------------------------------------------------------------
    #
    # The XXH3-64 of a block's bytes, when known. The copier records it while it writes a block
    # (no second pass) and storage backends use it instead of hashing again; a load records the
    # stored checksum and the copier verifies the bytes while it moves them on. A block written
    # any other way has no known checksum. A stale value (someone wrote into the block behind
    # kvtier's back) can only make a stored object fail its check later: a miss, never bad data.

    def _init_checksums(self) -> None:
        self._checksums = np.zeros(self.num_blocks, dtype=np.uint64)
        self._checksum_known = np.zeros(self.num_blocks, dtype=bool)

    def set_checksums(self, block_ids: np.ndarray, checksums: np.ndarray) -> None:
        self._checksums[block_ids] = checksums
        self._checksum_known[block_ids] = True

    def forget_checksums(self, block_ids: np.ndarray) -> None:
        self._checksum_known[block_ids] = False

    def known_checksums(self, block_ids) -> list[int | None]:
        """Per block: its recorded XXH3-64, or None."""
        ids = np.asarray(block_ids, dtype=np.int64)
        values, known = self._checksums[ids], self._checksum_known[ids]
        return [int(v) if k else None for v, k in zip(values.tolist(), known.tolist())]

    def compute_checksums(self, block_ids: np.ndarray) -> np.ndarray:
        """Hash blocks now (a pass over their bytes) and record the result."""
        from kvtier.storage.format import payload_checksum

        ids = np.asarray(block_ids, dtype=np.int64)
        values = np.array(
            [payload_checksum(self.slab[i].numpy()) for i in ids.tolist()], dtype=np.uint64
        )
        self.set_checksums(ids, values)
        return values

    # ---- views ------------------------------------------------------------------------------

    def check_ids(self, ids: np.ndarray, what: str = "host block id") -> None:
        bad = ids[(ids < 0) | (ids >= self.num_blocks)]
        if bad.size:
            raise InvalidBlockIds(f"{what} {int(bad[0])} out of range 0..{self.num_blocks - 1}")

    def block(self, block_id: int) -> torch.Tensor:
        """The bytes of one page-first block (a uint8 view, no copy)."""
        if not 0 <= block_id < self.num_blocks:
            raise InvalidBlockIds(f"host block id {block_id} out of range 0..{self.num_blocks - 1}")
        return self.slab[block_id]

    def piece(self, block_id: int, layer: int, part: Part) -> torch.Tensor:
        """One (layer, part) of one block, typed and shaped like one device block."""
        index = layer * len(self.spec.parts) + self.spec.parts.index(part)
        p = self.spec.pieces[index]
        raw = self.block(block_id)[p.offset_bytes : p.offset_bytes + p.size_bytes]
        return raw.view(self.spec.torch_dtype(part)).view(self.spec.part_shape(part, 1)[1:])

    def object_view(self, block_id: int) -> torch.Tensor:
        """The header slot and the block: one stored object's bytes, contiguous."""
        return self.objects[block_id]

    def block_address(self, block_id: int) -> int:
        return self.base_address + block_id * self.stride_bytes + HEADER_SLOT_BYTES

    def block_index(self, address: int) -> int | None:
        """The id of the block that starts at ``address``, or None."""
        offset = address - self.base_address - HEADER_SLOT_BYTES
        if (
            offset < 0
            or offset % self.stride_bytes
            or offset // self.stride_bytes >= self.num_blocks
        ):
            return None
        return offset // self.stride_bytes

    @property
    def base_address(self) -> int:
        """Start of the whole slab (header slots included): what zero-copy backends register."""
        return self.flat.data_ptr()

    def memoryview(self, block_id: int) -> memoryview:
        """A writable buffer over one block, for file and socket I/O without copies."""
        return memoryview(self.block(block_id).numpy()).cast("B")

    # ---- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Release the slab; a pool that created a shared backing unlinks it."""
        if self.pinned and self._path is not None:
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
        self.flat = torch.empty(0, dtype=torch.uint8)
        self.slab = self.flat.view(0, self.block_bytes)
        self.objects = self.flat.view(0, self.stride_bytes)
        if self._lock_fd is not None:
            if self._path is not None:
                _unlink_quietly(self._path)
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _register_pinned(flat: torch.Tensor) -> bool:
    """Page-lock shared memory for DMA; a refusal leaves it pageable and says so."""
    rc = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0)
    if int(rc) != 0:
        log.warning("cudaHostRegister failed (%s): shared host pool stays pageable", rc)
        return False
    return True
