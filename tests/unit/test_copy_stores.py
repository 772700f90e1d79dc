"""The store kind of kvtier's native copies (``kvtier.memory.stores``): streaming and cached
stores write the same bytes and hashes through every native copy, and a process keeps the kind
its own timed copies found faster — or the one ``KVTIER_COPY_STORES`` names."""

from __future__ import annotations

import numpy as np
import pytest
import xxhash

from conftest import require_native
from kvtier.errors import ConfigError
from kvtier.memory import stores

_copy = require_native("kvtier._copy")

OBJECT = 1 << 20  # pieces of 128 KiB: above the 4 KiB where streaming stores start


@pytest.fixture
def restore_kind():
    before = _copy.streaming()
    yield
    _copy.set_streaming(before)


def _scattered(streaming: bool, n: int = 6) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    src = rng.integers(0, 256, n * OBJECT, dtype=np.uint8)
    dst = np.zeros_like(src)
    whole = [memoryview(src[i * OBJECT : (i + 1) * OBJECT]) for i in range(n)]
    eighth = OBJECT // 8
    # Each object's pieces in reverse order: a scatter, not one contiguous copy.
    parts = [
        [
            memoryview(dst[i * OBJECT + k * eighth : i * OBJECT + (k + 1) * eighth])
            for k in range(8)
        ][::-1]
        for i in range(n)
    ]
    hashes = np.zeros(n, dtype=np.uint64)
    _copy.set_streaming(streaming)
    assert _copy.copy_scattered(whole, parts, True, hashes, 2) == n * OBJECT
    for i in range(n):
        got = b"".join(bytes(p) for p in parts[i])
        assert got == bytes(whole[i])
        assert int(hashes[i]) == xxhash.xxh3_64_intdigest(bytes(whole[i]))
    return dst, hashes


def test_both_kinds_write_the_same_bytes_and_hashes(restore_kind) -> None:
    dst_streaming, hashes_streaming = _scattered(True)
    dst_cached, hashes_cached = _scattered(False)
    assert np.array_equal(dst_streaming, dst_cached)
    assert np.array_equal(hashes_streaming, hashes_cached)


def test_a_plain_indexed_copy_is_the_same_with_either_kind(restore_kind) -> None:
    rng = np.random.default_rng(11)
    src = rng.integers(0, 256, 8 * OBJECT, dtype=np.uint8)
    one = np.array([OBJECT], dtype=np.int64)
    src_ids = np.array([5, 0, 7, 2], dtype=np.int64)
    dst_ids = np.array([0, 1, 2, 3], dtype=np.int64)
    out = {}
    for streaming in (True, False):
        dst = np.zeros(4 * OBJECT, dtype=np.uint8)
        _copy.set_streaming(streaming)
        base_d, base_s = np.array([dst.ctypes.data]), np.array([src.ctypes.data])
        _copy.copy_indexed(base_d, one, dst_ids, base_s, one, src_ids, one, 2)
        out[streaming] = dst
    for j, i in enumerate(src_ids):
        assert bytes(out[False][j * OBJECT : (j + 1) * OBJECT]) == bytes(
            src[i * OBJECT : (i + 1) * OBJECT]
        )
    assert np.array_equal(out[True], out[False])


class _Clock:
    """Time that passes by the kind in use: each copy advances it by that kind's seconds."""

    def __init__(self, seconds: dict[bool, float]) -> None:
        self.now, self.seconds, self.calls = 0.0, seconds, 0

    def __call__(self) -> float:
        return self.now

    def copy(self) -> int:
        self.now += self.seconds[_copy.streaming()]
        self.calls += 1
        return 42


@pytest.mark.parametrize("faster", ["streaming", "cached"])
def test_the_faster_kind_is_kept_after_timing_each_kind_on_the_same_copies(
    faster, restore_kind
) -> None:
    clock = _Clock({faster == "streaming": 0.001, faster != "streaming": 0.002})
    choice = stores.StoreChoice(_copy, "auto", samples=3, clock=clock)
    for _ in range(3):
        assert choice.kind is None
        assert choice.run(stores.MIN_BYTES, clock.copy) == 42
    assert choice.kind == faster
    assert _copy.streaming() == (faster == "streaming")
    assert {k: len(v) for k, v in choice.rates().items()} == {"streaming": 3, "cached": 3}
    assert clock.calls == 6  # each timed copy ran once with each kind
    clock.now = 0.0
    choice.run(stores.MIN_BYTES, clock.copy)  # chosen: no longer timed
    assert sum(len(v) for v in choice.rates().values()) == 6 and clock.calls == 7
    assert faster in choice.describe()


def test_slow_copies_do_not_decide(restore_kind) -> None:
    """On stop 52's host the first streaming copies ran at 2.3 and 8 GB/s (page faults of fresh
    memory, a busy neighbour) and the third at 11, against cached 9-12.7: the median chose cached
    stores, slower there. A copy is only ever slowed down, so the best of each kind decides."""
    clock = _Clock({True: 0.001, False: 0.0015})
    choice = stores.StoreChoice(_copy, "auto", samples=3, clock=clock)
    for slow in (0.01, 0.004, 0.001):  # streaming's copies: two slowed, one not
        clock.seconds[True] = slow
        choice.run(stores.MIN_BYTES, clock.copy)
    assert choice.kind == "streaming"


def test_small_copies_are_not_timed_and_a_named_kind_is_not_timed_at_all(restore_kind) -> None:
    clock = _Clock({True: 0.001, False: 0.002})
    choice = stores.StoreChoice(_copy, "auto", clock=clock)
    choice.run(stores.MIN_BYTES - 1, clock.copy)
    assert choice.rates() == {"streaming": [], "cached": []}
    fixed = stores.StoreChoice(_copy, "cached", clock=clock)
    assert fixed.kind == "cached" and not _copy.streaming()
    fixed.run(stores.MIN_BYTES, clock.copy)
    assert fixed.rates() == {"streaming": [], "cached": []}


def test_an_unknown_kind_is_a_config_error_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match="KVTIER_COPY_STORES"):
        stores.StoreChoice(_copy, "fast")
