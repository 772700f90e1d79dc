"""The payload checksum (XXH3-64) shared by the host pool, the copier and the storage format."""

from __future__ import annotations

import xxhash


def payload_checksum(payload) -> int:
    """XXH3-64 of a buffer (bytes, memoryview, numpy array); releases the GIL for large inputs.

    The native copier computes the same function while it copies (``kvtier._copy``), so a
    checksum recorded during a copy and one computed here agree byte for byte.
    """
    return xxhash.xxh3_64_intdigest(payload)
