"""The fault-injecting wrapper: passes the contract when quiet, injects what it is told."""

from __future__ import annotations

import time

import pytest

from kvtier.errors import ConfigError, StorageUnavailable
from kvtier.memory.host import HostPool
from kvtier.storage import make_backend
from kvtier.storage.wrappers.faults import FaultInjectingStore
from kvtier.testing.contract import CONTRACT_SPEC, StoreContract, expected_block, make_keys


class TestQuietFaultWrapper(StoreContract):
    def make_store(self, spec):
        return make_backend(spec, {"backend": "memory", "faults": {"latency_s": 0.0001}})


def _filled_pool(keys):
    pool = HostPool(CONTRACT_SPEC, 2 * len(keys))
    for i, key in enumerate(keys):
        pool.block(i).copy_(expected_block(key, pool.block_bytes))
    return pool


def test_corruption_is_injected_and_every_one_detected() -> None:
    store = make_backend(
        CONTRACT_SPEC, {"backend": "memory", "faults": {"corrupt_rate": 0.5, "seed": 3}}
    )
    assert isinstance(store, FaultInjectingStore)
    keys = make_keys(40)
    with _filled_pool(keys) as pool:
        assert all(store.put_from(keys, [pool.block(i) for i in range(40)]))
        got = store.get_into(keys, [pool.block(40 + i) for i in range(40)])
        for i, ok in enumerate(got):
            if ok:
                assert bool((pool.block(40 + i) == pool.block(i)).all())
    assert 10 < store.injected["corrupt"] < 30
    assert store.stats.corrupt == store.injected["corrupt"] == got.count(False)


def test_error_rate_fails_keys_not_calls() -> None:
    store = make_backend(
        CONTRACT_SPEC, {"backend": "memory", "faults": {"error_rate": 0.3, "seed": 1}}
    )
    keys = make_keys(50)
    with _filled_pool(keys) as pool:
        put = store.put_from(keys, [pool.block(i) for i in range(50)])
        assert put.count(False) == store.injected["put_error"] > 0
        assert [store.exists_prefix([k]) == 1 for k in keys] == put  # failed puts are invisible


def test_stalls_delay_some_reads_and_lose_no_byte() -> None:
    """``stall_rate`` of the reads take ``stall_s`` longer; every byte still arrives."""
    store = make_backend(
        CONTRACT_SPEC,
        {"backend": "memory", "faults": {"stall_rate": 0.3, "stall_s": 0.05, "seed": 2}},
    )
    keys = make_keys(4)
    with _filled_pool(keys) as pool:
        assert all(store.put_from(keys, [pool.block(i) for i in range(4)]))
        slow = 0
        for _ in range(30):
            start = time.perf_counter()
            assert all(store.get_into(keys, [pool.block(4 + i) for i in range(4)]))
            slow += time.perf_counter() - start >= 0.05
            for i in range(4):
                assert bool((pool.block(4 + i) == pool.block(i)).all())
    assert slow == store.injected["stall"] and 3 <= slow <= 18


def test_outage_window_and_manual_switch() -> None:
    store = make_backend(
        CONTRACT_SPEC,
        {"backend": "memory", "faults": {"unavailable_after_s": 0.0, "unavailable_for_s": 0.2}},
    )
    keys = make_keys(1)
    with pytest.raises(StorageUnavailable, match="injected outage"):
        store.exists_prefix(keys)
    time.sleep(0.25)
    assert store.exists_prefix(keys) == 0
    store.set_unavailable(True)
    with pytest.raises(StorageUnavailable):
        store.get_into([], [])
    store.set_unavailable(False)
    assert store.injected["unavailable"] == 2


def test_an_outage_lasts_exactly_while_its_file_exists(tmp_path) -> None:
    flag = tmp_path / "outage"
    store = make_backend(
        CONTRACT_SPEC, {"backend": "memory", "faults": {"unavailable_while": str(flag)}}
    )
    keys = make_keys(1)
    assert store.exists_prefix(keys) == 0
    flag.touch()
    with pytest.raises(StorageUnavailable, match="injected outage"):
        store.exists_prefix(keys)
    flag.unlink()
    assert store.exists_prefix(keys) == 0
    assert store.injected["unavailable"] == 1
    with pytest.raises(ConfigError, match="storage.faults.unavailable_while"):
        make_backend(CONTRACT_SPEC, {"backend": "memory", "faults": {"unavailable_while": 3}})


def test_fault_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="storage.faults.error_rate"):
        make_backend(CONTRACT_SPEC, {"backend": "memory", "faults": {"error_rate": 2}})
    with pytest.raises(ConfigError, match="storage.faults.jitter: unknown fault option"):
        make_backend(CONTRACT_SPEC, {"backend": "memory", "faults": {"jitter": 1}})


def test_every_way_a_worker_looks_up_goes_through_the_faults() -> None:
    """The worker asks ``prefix_tiers`` (and answers on its loop thread when lookups are
    quick): a wrapper that forwarded either to the store it wraps would make an injected
    latency or outage miss lookups (seen when the wrapper moved onto the delegating base)."""
    store = make_backend(CONTRACT_SPEC, {"backend": "memory", "faults": {"latency_s": 0.2}})
    assert isinstance(store, FaultInjectingStore) and store.wrapped.quick_lookups
    assert not store.quick_lookups  # its lookups sleep by design: never on the loop thread
    start = time.monotonic()
    assert store.prefix_tiers(make_keys(2)) == (0, b"")
    assert store.exists_prefix(make_keys(2)) == 0
    assert time.monotonic() - start >= 0.4
    store.set_unavailable(True)
    with pytest.raises(StorageUnavailable):
        store.prefix_tiers(make_keys(1))
    store.close()
