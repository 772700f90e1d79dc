"""The fused copy of ``kvtier._copy``: pieces of whole 64-byte lines, each at a 64-byte aligned
destination, copied with streaming stores, are hashed in the same pass (XXH3's accumulators fed
as the lines go by). Its hash must be XXH3-64 of the bytes for every length (a whole number of
XXH3 blocks or not, one line past one) and every split into pieces (empty ones included), in
``copy_scattered`` and ``copy_blocks_hashed``; pieces it cannot take (uneven, an unaligned
destination) and cached stores go the other way with the same result."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from conftest import require_native

_copy = require_native("kvtier._copy")

KIB = 1024
# Lengths around XXH3's 1 KiB blocks: a whole number of them (its last block is the "partial"
# one), one line past, one line short, and larger objects with a remainder.
LENGTHS = [4 * KIB, 4 * KIB + 64, 5 * KIB - 64, 64 * KIB, (1 << 20) + 3 * KIB + 5 * 64]


@pytest.fixture(params=[True, False], ids=["streaming", "cached"])
def kind(request):
    before = _copy.streaming()
    _copy.set_streaming(request.param)
    yield request.param
    _copy.set_streaming(before)


def _splits(length: int) -> dict[str, list[int]]:
    lines = length // 64
    return {
        "one piece": [length],
        "lines": [64] * 3 + [length - 3 * 64],
        "with empty pieces": [0, 2 * KIB, 0, length - 2 * KIB, 0],
        "uneven": [100, length - 100],  # not whole lines: the other way
        "thirds": [64 * (lines // 3), 64 * (lines // 3), length - 128 * (lines // 3)],
    }


def _check(src: list[np.ndarray], parts: list[list[memoryview]]) -> None:
    hashes = np.zeros(len(src), dtype=np.uint64)
    moved = _copy.copy_scattered(src, parts, True, hashes, 2 if len(src) > 1 else 1)
    assert moved == sum(a.nbytes for a in src)
    for whole, row, h in zip(src, parts, hashes):
        assert b"".join(bytes(p) for p in row) == whole.tobytes()
        assert int(h) == xxhash.xxh3_64_intdigest(whole.tobytes())


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("split", ["one piece", "lines", "with empty pieces", "uneven", "thirds"])
def test_each_length_and_split_hashes_as_xxh3(kind, length, split) -> None:
    rng = np.random.default_rng(length)
    sizes = _splits(length)[split]
    src = [rng.integers(0, 256, length, dtype=np.uint8) for _ in range(3)]
    # Each object's pieces in one buffer, in reverse order: a scatter.
    out = [np.zeros(length, dtype=np.uint8) for _ in range(3)]
    parts = []
    for buffer in out:
        views, at = [], 0
        for n in sizes:
            views.append(memoryview(buffer[at : at + n]))
            at += n
        parts.append(views[::-1])
    _check(src, parts)


@pytest.mark.parametrize("past_a_line", [8, 16])  # not 16-byte aligned; not 64-byte aligned
def test_an_unaligned_destination_takes_the_other_way(kind, past_a_line) -> None:
    rng = np.random.default_rng(3)
    src = [rng.integers(0, 256, 64 * KIB, dtype=np.uint8)]
    backing = np.zeros(64 * KIB + 64, dtype=np.uint8)
    start = (-backing.ctypes.data) % 64 + past_a_line
    parts = [[memoryview(backing[start : start + 64 * KIB])]]
    _check(src, parts)


def test_a_scattered_source_hashes_in_piece_order(kind) -> None:
    """From pieces into one buffer (a save): the hash follows the pieces' order."""
    rng = np.random.default_rng(4)
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in (32 * KIB, 4 * KIB, 28 * KIB)]
    whole = np.zeros(64 * KIB, dtype=np.uint8)
    hashes = np.zeros(1, dtype=np.uint64)
    _copy.copy_scattered([whole], [[memoryview(p) for p in pieces[::-1]]], False, hashes, 1)
    expected = b"".join(p.tobytes() for p in pieces[::-1])
    assert whole.tobytes() == expected
    assert int(hashes[0]) == xxhash.xxh3_64_intdigest(expected)


def test_a_contiguous_source_within_one_buffer(kind) -> None:
    """Objects cut from one slab (the memory tier's payloads): each is fused on its own."""
    rng = np.random.default_rng(5)
    slab = rng.integers(0, 256, 8 * (64 * KIB + 64), dtype=np.uint8)
    src = [slab[i * (64 * KIB + 64) + 64 : (i + 1) * (64 * KIB + 64)] for i in range(8)]
    out = np.zeros(8 * 64 * KIB, dtype=np.uint8)
    parts = [
        [memoryview(out[(i * 4 + k) * 16 * KIB : (i * 4 + k + 1) * 16 * KIB]) for k in range(4)]
        for i in range(8)
    ]
    _check(src, parts)


@pytest.mark.parametrize("length", LENGTHS)
def test_a_hashed_block_copy_of_whole_lines_hashes_as_xxh3(kind, length) -> None:
    """``copy_blocks_hashed`` (a swap out, hashed as it copies): blocks of pieces from
    scattered sources, each block's hash the XXH3-64 of its pieces in order."""
    rng = np.random.default_rng(length + 1)
    sizes = _splits(length)["thirds"]
    blocks = 4
    src = [rng.integers(0, 256, n, dtype=np.uint8) for _ in range(blocks) for n in sizes]
    dst = [np.zeros(n, dtype=np.uint8) for _ in range(blocks) for n in sizes]

    def pointers(arrays):
        return np.array([a.ctypes.data for a in arrays], dtype=np.int64)

    hashes = np.zeros(blocks, dtype=np.uint64)
    lengths = np.array(sizes * blocks, dtype=np.int64)
    _copy.copy_blocks_hashed(pointers(dst), pointers(src), lengths, len(sizes), hashes, 2)
    assert all(np.array_equal(a, b) for a, b in zip(src, dst))
    for b in range(blocks):
        block = b"".join(a.tobytes() for a in src[b * len(sizes) : (b + 1) * len(sizes)])
        assert int(hashes[b]) == xxhash.xxh3_64_intdigest(block)


def _page_aligned(nbytes: int) -> np.ndarray:
    backing = np.zeros(nbytes + 2 * 4 * KIB, dtype=np.uint8)
    start = (-backing.ctypes.data) % (4 * KIB)
    return backing[start : start + nbytes + 4 * KIB]


@pytest.mark.parametrize("offset", [0, 64, 65, 2 * KIB, 4 * KIB - 64, 4 * KIB - 1])
@pytest.mark.parametrize("length", [3 * KIB, 64 * KIB, (1 << 20) + 3 * 4 * KIB + 5 * 64])
def test_a_source_at_any_page_offset(kind, offset, length) -> None:
    """A copy walks the source's pages: the lines before its first page boundary go one by one,
    then groups of pages (the last smaller), then the lines left. Every offset from a page,
    a line's and a byte's, gives the same bytes and XXH3-64, hashed or not."""
    rng = np.random.default_rng(offset + length)
    backing = _page_aligned(length)
    src = backing[offset : offset + length]
    src[:] = rng.integers(0, 256, length, dtype=np.uint8)
    out = _page_aligned(length)[:length]
    _check([src], [[memoryview(out)]])
    out[:] = 0
    assert _copy.copy_scattered([src], [[memoryview(out)]], True, None, 1) == length
    assert out.tobytes() == src.tobytes()


def test_pieces_from_sources_at_different_page_offsets(kind) -> None:
    """A save: each piece's source starts at its own offset from a page, and the hash follows
    the pieces in order across the lines each copies one by one."""
    rng = np.random.default_rng(6)
    sizes, offsets = (20 * KIB, 64, 16 * KIB + 128, 9 * KIB), (64, 0, 3 * KIB, 4 * KIB - 128)
    pieces = []
    for n, offset in zip(sizes, offsets):
        backing = _page_aligned(n)
        backing[offset : offset + n] = rng.integers(0, 256, n, dtype=np.uint8)
        pieces.append(backing[offset : offset + n])
    whole = _page_aligned(sum(sizes))[: sum(sizes)]
    hashes = np.zeros(1, dtype=np.uint64)
    _copy.copy_scattered([whole], [[memoryview(p) for p in pieces]], False, hashes, 1)
    expected = b"".join(p.tobytes() for p in pieces)
    assert whole.tobytes() == expected
    assert int(hashes[0]) == xxhash.xxh3_64_intdigest(expected)
