"""HostPool: one pre-touched, page-first slab of host blocks (pinned when CUDA is present)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvtier.errors import ConfigError, InvalidBlockIds
from kvtier.layout.block_ids import check_block_ids
from kvtier.layout.checksum import payload_checksum
from kvtier.layout.spec import KVCacheSpec, Part

log = logging.getLogger(__name__)


# Each block is preceded by a slot for its storage header, so that [header | block] -- exactly
# one stored object -- is one contiguous range: a single buffer per object for Mooncake and
# file I/O instead of two (measured: two-buffer gets over TCP ran at 0.6-0.8x).
HEADER_SLOT_BYTES = 64
# Pre-touching runs in chunks of this size so that a large pool reports progress.
TOUCH_CHUNK_BYTES = 1 << 30
PROGRESS_INTERVAL_S = 2.0
# Refuse a private pool that would leave less than this much memory to everything else.
MEMORY_RESERVE_BYTES = 256 << 20


@dataclass(frozen=True)
class HostLayout:
    """A worker's host pool: engine-addressed blocks, then two private staging ranges.

    Blocks ``0 .. engine_blocks-1`` are the engine's (``swap_out``/``swap_in``/``*_host`` tasks
    name them); the save and load staging ranges follow, so storage tasks never touch the
    engine's blocks and a save and a load can run at once.
    """

    engine_blocks: int
    staging_blocks: int

    @property
    def total_blocks(self) -> int:
        return self.engine_blocks + 2 * self.staging_blocks

    @property
    def save_staging(self) -> np.ndarray:
        first = self.engine_blocks
        return np.arange(first, first + self.staging_blocks, dtype=np.int64)

    @property
    def load_staging(self) -> np.ndarray:
        first = self.engine_blocks + self.staging_blocks
        return np.arange(first, first + self.staging_blocks, dtype=np.int64)


class HostPool:
    """``num_blocks`` host blocks of ``spec.block_bytes`` each, in one slab.

    Page-first: host block i holds layer 0 K, layer 0 V, [layer 0 scales], layer 1 K, ...
    contiguously, so one block is one contiguous range (one storage object, one DMA). Blocks are
    ``stride_bytes`` apart: each is preceded by a ``HEADER_SLOT_BYTES`` slot where storage
    backends build the object header (``object_view``).
    The slab is allocated once and zeroed at construction (first touch of fresh memory runs at
    2-4 GB/s here, warm memory at 13-16), so no transfer ever pays for page faults; a pool larger
    than the memory available is refused before anything is allocated.

    Views are safe to use from several threads as long as no two writers touch one block.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, *, pin: bool | None = None) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError("num_host_blocks", f"must be a positive integer, got {num_blocks!r}")
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_bytes = spec.block_bytes
        self.stride_bytes = HEADER_SLOT_BYTES + spec.block_bytes
        self.size_bytes = num_blocks * self.stride_bytes
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self._set_flat(page_aligned_slab(self.size_bytes, "num_host_blocks", self.pinned))
        log.info(
            "host pool: %d blocks x %d bytes = %.2f GiB%s",
            num_blocks,
            self.block_bytes,
            self.size_bytes / 2**30,
            ", pinned" if self.pinned else "",
        )

    def _set_flat(self, flat: torch.Tensor) -> None:
        self.flat = flat
        # [num_blocks, block_bytes] views of the payloads, and of [header slot | payload].
        self.slab = flat.as_strided(
            (self.num_blocks, self.block_bytes),
            (self.stride_bytes, 1),
            flat.storage_offset() + HEADER_SLOT_BYTES,  # as_strided counts from the storage
        )
        self.objects = flat.view(self.num_blocks, self.stride_bytes)
        self._checksums = np.zeros(self.num_blocks, dtype=np.uint64)
        self._checksum_known = np.zeros(self.num_blocks, dtype=bool)

    # ---- checksums --------------------------------------------------------------------------
    #
    # The XXH3-64 of a block's bytes, when known. The copier records it while it writes a block
    # (no second pass) and storage backends use it instead of hashing again; a load records the
    # stored checksum and the copier verifies the bytes while it moves them on. A block written
    # any other way has no known checksum. A stale value (someone wrote into the block behind
    # kvtier's back) can only make a stored object fail its check later: a miss, never bad data.

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

    def expected_checksums(self, block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(recorded checksums, known flags) of ``block_ids``, as arrays (for verification)."""
        return self._checksums[block_ids], self._checksum_known[block_ids]

    def checksums_match(self, block_ids: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        """Per block: is a checksum recorded, and does it equal ``hashes[i]``?"""
        expected, known = self.expected_checksums(block_ids)
        return known & (expected == hashes)

    def compute_checksums(self, block_ids: np.ndarray) -> np.ndarray:
        """Hash blocks now (a pass over their bytes); returns them without recording them."""
        ids = np.asarray(block_ids, dtype=np.int64)
        return np.array(
            [payload_checksum(self.slab[i].numpy()) for i in ids.tolist()], dtype=np.uint64
        )

    # ---- views ------------------------------------------------------------------------------

    def check_ids(self, ids: np.ndarray, *, destination: bool = False) -> None:
        check_block_ids(ids, self.num_blocks, "host block id", destination=destination)

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
        return memoryview(self.block(block_id).numpy()).cast("B")  # type: ignore[arg-type]

    # ---- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Release the slab."""
        self.flat = torch.empty(0, dtype=torch.uint8)
        self.slab = self.flat.view(0, self.block_bytes)
        self.objects = self.flat.view(0, self.stride_bytes)

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def copy_block(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One host block into another on the calling thread (numpy's copy: the GIL released, no
    thread pool). torch's ``copy_`` splits a block over its OpenMP threads, and a thread that
    lands on a core something else keeps busy waits for a time slice there: beside a process
    spinning on the other core of this 2-core machine a load's 14 copies of 1 MiB took 88 ms
    that way and 4.7 ms on one thread."""
    np.copyto(dst.numpy(), src.numpy())


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_memory_available(size_bytes: int, field: str) -> None:
    """ConfigError naming ``field`` when ``size_bytes`` would not fit in available memory."""
    available = available_memory_bytes()
    if available is not None and size_bytes > available - MEMORY_RESERVE_BYTES:
        raise ConfigError(
            field,
            f"needs {size_bytes / 2**30:.2f} GiB of host memory but only "
            f"{available / 2**30:.2f} GiB is available: use fewer blocks",
        )


PAGE_BYTES = 4096


def page_aligned_slab(size_bytes: int, field: str, pin: bool | None = None) -> torch.Tensor:
    """``size_bytes`` of host memory starting on a page, pre-touched (zeroed) and pinned where
    CUDA is present (``pin``: None); ConfigError naming ``field`` when it would not fit."""
    check_memory_available(size_bytes + PAGE_BYTES, field)
    pinned = torch.cuda.is_available() if pin is None else pin
    flat = torch.empty(size_bytes + PAGE_BYTES, dtype=torch.uint8, pin_memory=pinned)
    start = -flat.data_ptr() % PAGE_BYTES
    slab = flat[start : start + size_bytes]
    _pre_touch(slab)
    return slab


def _pre_touch(flat: torch.Tensor) -> None:
    """Zero the slab chunk by chunk, logging progress every few seconds for a large pool."""
    total = flat.numel()
    start = last = time.monotonic()
    for offset in range(0, total, TOUCH_CHUNK_BYTES):
        flat[offset : offset + TOUCH_CHUNK_BYTES].zero_()
        now = time.monotonic()
        if now - last >= PROGRESS_INTERVAL_S:
            last = now
            done = min(total, offset + TOUCH_CHUNK_BYTES)
            log.info(
                "host pool: pre-touched %.1f of %.1f GiB (%.1f GB/s)",
                done / 2**30,
                total / 2**30,
                done / (now - start) / 1e9,
            )
