"""The memory tier's slots: each object's header in one small array, its payload in one
page-aligned slab (pre-touched, so no save pays for page faults; pinned where CUDA is present,
so a hit is one DMA away).

Payloads start on pages (every one, when a block is whole pages): a copy out of the tier walks
whole pages of its source. With headers in front of payloads (stop 52's layout: each slot one
contiguous ``[header | payload]``), payload ``i`` started ``64 * (i + 1)`` bytes past a page,
and hashed loads of 1 MiB blocks ran at 0.82-0.89 of the page-aligned rate here.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier.memory.host import page_aligned_slab
from kvtier.storage.format import HEADER_BYTES


class ArenaMemory:
    """``slots`` objects of a header and a ``payload_bytes`` payload each."""

    def __init__(self, payload_bytes: int, slots: int) -> None:
        self._slab = page_aligned_slab(slots * payload_bytes, "storage.capacity_bytes")
        data = self._slab.numpy()
        self.payloads: list[memoryview] = [
            data[i * payload_bytes : (i + 1) * payload_bytes].data for i in range(slots)
        ]
        self._headers = np.zeros((slots, HEADER_BYTES), dtype=np.uint8)
        self.headers: list[memoryview] = [row.data for row in self._headers]

    def read(self, slot: int, length: int) -> bytes:
        """The first ``length`` bytes of the object in ``slot``: header, then payload."""
        head = min(length, HEADER_BYTES)
        return b"".join((self.headers[slot][:head], self.payloads[slot][: length - head]))

    def write(self, slot: int, data: bytes) -> None:
        """``data`` (an object: a header, then at most one payload) into ``slot``."""
        head = min(len(data), HEADER_BYTES)
        self.headers[slot][:head] = data[:head]
        self.payloads[slot][: len(data) - head] = data[head:]

    def close(self) -> None:
        self.payloads, self.headers = [], []
        self._slab = torch.empty(0, dtype=torch.uint8)
