"""The tier chain: the storage contract as one backend, promotion, writing down (through and
back), nothing dirty lost on eviction or a clean stop, a lower tier down, its configuration."""

from __future__ import annotations

import time

import pytest

from kvtier.errors import ConfigError, StorageUnavailable
from kvtier.memory.host import HostPool
from kvtier.storage import make_backend, parse_storage
from kvtier.storage.chain import writer as tier_writer
from kvtier.storage.chain.store import TieredStore
from kvtier.storage.memory.store import MemoryStore
from kvtier.testing.contract import CONTRACT_SPEC, StoreContract, expected_block, make_keys
from worker_helpers import HostBlocksOnlyStore

OBJECT_BYTES = CONTRACT_SPEC.block_bytes + 64


class TestMemoryOverFileThrough(StoreContract):
    persistent = True  # the file tier below

    write = "through"

    @pytest.fixture(autouse=True)
    def _root(self, tmp_path):
        self.root = tmp_path / "store"

    def store_config(self) -> dict:
        return {
            "tiers": [{"backend": "memory"}, {"backend": "file", "root": str(self.root)}],
            "write": self.write,
        }

    def make_store(self, spec):
        return make_backend(spec, self.store_config())


class TestMemoryOverFileBack(TestMemoryOverFileThrough):
    write = "back"


class TestMemoryOverHostBlocksOnly(StoreContract):
    """Memory over a tier that reads into host blocks only (Mooncake's kind): the chain as a
    whole does not read scattered, so the contract's scattered sections are skipped; the
    top tier's scattered reads are tested below."""

    def make_store(self, spec):
        return TieredStore([MemoryStore(spec), HostBlocksOnlyStore(spec)])


@pytest.fixture
def pool():
    with HostPool(CONTRACT_SPEC, 16) as pool:
        yield pool


def _chain(tmp_path, write: str = "through", top_objects: int | None = None, **file_options):
    capacity = None if top_objects is None else top_objects * OBJECT_BYTES
    top = {"backend": "memory"} | ({"capacity_bytes": capacity} if capacity else {})
    lower = {"backend": "file", "root": str(tmp_path / "store"), **file_options}
    return make_backend(CONTRACT_SPEC, {"tiers": [top, lower], "write": write})


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the writer never got there"
        time.sleep(0.01)


def _put(store, pool, keys):
    blocks = [pool.block(i) for i in range(len(keys))]
    for key, block in zip(keys, blocks):
        block.copy_(expected_block(key, block.numel()))
    return store.put_from(keys, blocks)


def _get(store, pool, keys):
    blocks = [pool.block(8 + i) for i in range(len(keys))]
    for block in blocks:
        block.fill_(0xEE)
    got = store.get_into(keys, blocks)
    for key, block, ok in zip(keys, blocks, got):
        if ok:
            assert block.equal(expected_block(key, block.numel())), key
    return got


def test_a_block_loaded_from_below_is_promoted_and_then_served_from_memory(tmp_path, pool):
    with _chain(tmp_path) as chain:
        keys = make_keys(4)
        assert _put(chain, pool, keys) == [True] * 4
        assert chain.writer.flush(30) == 0  # written through
        top, below = chain.tiers
        assert below.exists_prefix(keys) == 4
        assert chain.prefix_tiers(keys) == (4, b"")  # all in the first tier
        top.delete(keys[1:3])  # as if evicted (held below)
        assert chain.exists_prefix(keys) == 4  # the prefix runs across tiers
        # a run from the first tier that holds its first block (as a scattered load reads it)
        assert chain.prefix_tiers(keys) == (4, bytes([0, 1, 1, 1]))
        assert chain.prefix_tiers(keys[:2]) == (2, bytes([0, 1]))
        hits_below = below.stats.hits
        assert _get(chain, pool, keys) == [True] * 4
        assert below.stats.hits == hits_below + 2 and chain.promotion.count == 2
        assert top.exists_prefix(keys) == 4  # promoted
        assert _get(chain, pool, keys) == [True] * 4
        assert below.stats.hits == hits_below + 2  # the second load: memory only


def test_write_back_hands_evicted_blocks_down_and_loses_none_at_a_clean_stop(tmp_path, pool):
    keys = make_keys(6)
    with _chain(tmp_path, "back", top_objects=2) as chain:
        top, below = chain.tiers
        for key in keys:  # one at a time: each put evicts the oldest
            assert _put(chain, pool, [key]) == [True]
        assert top.usage().num_objects == 2
        _wait_for(lambda: below.usage().num_objects == 4)  # the 4 evicted, handed down
        assert chain.writer.pending == 2  # the 2 in memory: dirty until the stop
        assert _get(chain, pool, keys) == [True] * 6  # every block, from one tier or the other
        assert chain.stats.evictions >= 4
    with make_backend(CONTRACT_SPEC, {"backend": "file", "root": str(tmp_path / "store")}) as f:
        assert f.exists_prefix(keys) == 6  # the stop wrote the dirty ones: 0 lost
        with HostPool(CONTRACT_SPEC, 16) as other:
            assert _get(f, other, keys) == [True] * 6


def test_write_back_keeps_nothing_below_until_it_is_evicted(tmp_path, pool):
    with _chain(tmp_path, "back", top_objects=4) as chain:
        keys = make_keys(2)
        _put(chain, pool, keys)
        assert chain.tiers[1].usage().num_objects == 0 and chain.writer.pending == 2
        stats = {row["backend"]: row for row in chain.tier_stats()}
        assert stats["memory"]["pending_writes"] == 2


def test_a_lower_tier_that_is_down_costs_only_its_own_hits(tmp_path, pool, monkeypatch):
    monkeypatch.setattr(tier_writer, "DOWN_S", 0.05)
    outage = tmp_path / "outage"
    faults = {"faults": {"unavailable_while": str(outage)}}
    with _chain(tmp_path, **faults) as chain:
        top, below = chain.tiers
        held_below = make_keys(2)
        _put(chain, pool, held_below)
        assert chain.writer.flush(30) == 0
        top.delete(held_below)
        outage.touch()
        keys = make_keys(3)
        assert _put(chain, pool, keys) == [True] * 3  # the top tier takes saves
        assert _get(chain, pool, keys) == [True] * 3  # and serves them
        assert chain.exists_prefix(held_below) == 0  # the down tier's own hits: misses
        assert _get(chain, pool, held_below) == [False, False]  # no exception
        assert chain.writer.flush(30) == 0
        assert chain.writer.counts.write_failures >= 3  # counted, not queued forever
        assert chain.health.unavailable[1] > 0
        outage.unlink()
        time.sleep(0.1)  # past DOWN_S
        assert _get(chain, pool, held_below) == [True, True]  # back: served and promoted
        later = make_keys(1)
        _put(chain, pool, later)
        assert chain.writer.flush(30) == 0
        assert below.exists_prefix(later) == 1


def test_every_tier_down_is_unavailable(tmp_path, pool):
    outage = tmp_path / "outage"
    outage.touch()
    down = {
        "backend": "file",
        "root": str(tmp_path / "a"),
        "faults": {"unavailable_while": str(outage)},
    }
    config = {"tiers": [down, dict(down, root=str(tmp_path / "b"))]}
    with make_backend(CONTRACT_SPEC, config) as chain, pytest.raises(StorageUnavailable):
        chain.exists_prefix(make_keys(1))


@pytest.mark.parametrize(
    ("storage", "field"),
    [
        ({"tiers": []}, "storage.tiers"),
        ({"tiers": [{"backend": "memory"}], "write": "sometimes"}, "storage.write"),
        (
            {"tiers": [{"backend": "file", "root": "/x"}, {"backend": "memory"}], "write": "back"},
            "storage.write",
        ),
        (
            {"tiers": [{"backend": "memory"}, {"backend": "file", "rot": "/x"}]},
            "storage.tiers[1].rot",
        ),
        (
            {"tiers": [{"backend": "memory", "capacity_bytes": -1}]},
            "storage.tiers[0].capacity_bytes",
        ),
        ({"tiers": [{"backend": "disk"}]}, "storage.tiers[0].backend"),
        ({"tiers": ["memory"]}, "storage.tiers[0]"),
        ({"tiers": [{"backend": "memory", "mac_key_file": "k"}]}, "storage.tiers[0].mac_key_file"),
        ({"tiers": [{"backend": "memory"}], "pending_bytes": 0}, "storage.pending_bytes"),
        ({"tiers": [{"backend": "memory"}], "capacity_bytes": 5}, "storage.capacity_bytes"),
    ],
)
def test_chain_configuration_errors_name_the_field(storage, field) -> None:
    with pytest.raises(ConfigError) as error:
        parse_storage(storage)
    assert error.value.field == field


def test_one_tier_is_a_chain_of_one(tmp_path, pool) -> None:
    with make_backend(CONTRACT_SPEC, {"tiers": [{"backend": "memory"}]}) as chain:
        assert isinstance(chain, TieredStore) and chain.writer is None
        keys = make_keys(2)
        assert _put(chain, pool, keys) == [True, True]
        assert _get(chain, pool, keys) == [True, True]


def test_a_workers_stats_status_and_metrics_show_each_tier(tmp_path) -> None:
    """Through a real client: the counters per tier reach ``stats``, ``kvtier status``'s
    table and the exporter (a tier label)."""
    from prometheus_client import generate_latest

    from kvtier.engine.client import Client
    from kvtier.ops.status import screen
    from kvtier.transport import tasks as t
    from kvtier.worker.metrics import WorkerMetrics
    from worker_helpers import local_worker

    storage = {"tiers": [{"backend": "memory"}, {"backend": "file", "root": str(tmp_path)}]}
    worker = local_worker("tier", storage=storage)
    try:
        with Client.connect([worker.config.endpoint], start_timeout_s=10) as client:
            hashes = [bytes([i]) * 32 for i in range(3)]
            assert client.save(hashes, [0, 1, 2]).status is t.Status.OK
            assert client.load(hashes, [3, 4, 5]).blocks == [3, 4, 5]
            stats = client.control("stats").per_rank[0].data
            assert client.lookup_tiers(hashes) == (3, b"")
            chain = worker.resources.storage
            assert chain.writer.flush(30) == 0  # written through (asynchronously) to the file
            chain.tiers[0].delete(worker.resources.keys.keys(hashes[1:]))  # as if evicted
            assert client.lookup_tiers(hashes) == (3, bytes([0, 1, 1]))
            assert client.lookup(hashes) == 3
        assert stats["storage_backend"] == "memory+file"
        memory, file = stats["storage_tiers"]["0"], stats["storage_tiers"]["1"]
        assert memory["hits"] == 3 and memory["puts"] == 3 and file["hits"] == 0
        lines = screen([stats], "title")
        assert any(line.split()[:3] == ["0", "1", "file"] for line in lines), lines
        text = generate_latest(WorkerMetrics(0, lambda: stats).registry).decode()
        assert (
            'kvtier_storage_tier_blocks_total{backend="memory",rank="0",result="hit",tier="0"} 3.0'
            in text
        )
    finally:
        worker.close()


def test_a_chain_reads_scattered_from_its_top_tier_and_stops_where_only_below_holds(pool):
    """Memory over a tier without scattered reads: the chain's ``scattered()`` answers the blocks
    the top tier holds and stops, target untouched, at one only the tier below holds (the
    worker reads that one through host blocks); a scattered save with the top tier down has
    nowhere to go and says so."""
    chain = TieredStore([MemoryStore(CONTRACT_SPEC), HostBlocksOnlyStore(CONTRACT_SPEC)])
    io = chain.scattered()
    assert io is not None and not io.covers_all
    keys = make_keys(3)
    assert _put(chain, pool, keys) == [True] * 3
    assert chain.writer is not None and chain.writer.flush(30) == 0
    chain.tiers[0].delete(keys[1:2])
    nbytes = CONTRACT_SPEC.block_bytes
    targets = [[bytearray(nbytes // 2), bytearray(nbytes // 2)] for _ in keys]
    for t in targets[1]:
        t[:] = b"\xee" * len(t)
    assert io.get_into_scattered(keys, targets) == [True, False, False]
    assert bytes(targets[0][0] + targets[0][1]) == expected_block(keys[0], nbytes).numpy().tobytes()
    assert all(set(t) == {0xEE} for t in targets[1])
    assert (chain.stats.hits, chain.stats.misses) == (1, 0)  # the caller reads on (below)
    assert _get(chain, pool, keys) == [True] * 3  # through host blocks: every tier
    assert (chain.stats.hits, chain.stats.misses) == (4, 0)
    chain.health.down(0, StorageUnavailable("test: the top tier is down"))
    with pytest.raises(StorageUnavailable, match="pieces is unavailable"):
        io.put_from_scattered(make_keys(1), [[bytearray(nbytes)]])
    chain.close()


@pytest.mark.parametrize("top_objects", [None, 8], ids=["memory", "arena"])
def test_an_object_that_fails_its_checks_in_the_top_tier_is_not_written_down(
    tmp_path, pool, top_objects
):
    """The writer reads each object from the top tier straight into its ring, checked there:
    one whose payload rotted in memory never reaches a lower tier, is counted as a failed
    write and is gone from the top tier too (its blocks are recomputed and saved again)."""
    with _chain(tmp_path, "back", top_objects) as chain:
        top, below = chain.tiers
        keys = make_keys(3)
        assert _put(chain, pool, keys) == [True] * 3
        data = bytearray(top.read_object(keys[1]))
        data[-1] ^= 0x01  # the payload's last byte
        top.write_object(keys[1], bytes(data))
        assert chain.writer.flush(30) == 0
        assert [below.exists_prefix([k]) for k in keys] == [1, 0, 1]
        assert chain.writer.counts.write_failures == 1 and chain.writer.counts.written == 2
        assert top.exists_prefix(keys) == 1 and top.stats.corrupt == 1
        assert top.stats.hits == 0  # the writer's reads are not the engine's hits


def _router_view(stored: set[str], removed: list[str]) -> set[str]:
    """What a router that replays the events holds: stored, minus removed, in order."""
    return stored - set(removed)


def _content(chain, keys) -> set[str]:
    return {k for k in keys if any(t.holds(k) for t in chain.tiers)}


@pytest.mark.parametrize("write", ["through", "back"])
def test_kv_events_of_a_chain_match_its_content_after_evictions(tmp_path, pool, write):
    """Every tier evicts (memory 3 objects, file 6): the router's view (stored minus removed)
    is exactly what the chain holds, in both write modes."""
    capacity = 6 * OBJECT_BYTES
    with _chain(tmp_path, write, top_objects=3, capacity_bytes=capacity) as chain:
        removed: list[str] = []
        chain.watch_removals(removed.extend)
        stored: set[str] = set()
        every: list[str] = []
        for _ in range(6):
            keys = make_keys(4)
            every += keys
            stored |= {k for k, ok in zip(keys, _put(chain, pool, keys)) if ok}
            assert chain.writer.flush(30) == 0
            _get(chain, pool, every[:1])  # a promotion too, while it is held
        assert chain.writer.flush(30) == 0
        held = _content(chain, every)
        assert len(held) >= 3 and len(set(removed)) >= len(every) - 9  # both tiers evicted
        assert _router_view(stored, removed) == held


def test_a_dirty_block_dropped_for_a_lower_tier_down_is_told_as_removed(tmp_path, pool):
    """Write-back: the memory tier evicts dirty blocks while the file tier is down; the writer
    cannot write them down, so they leave the chain, and the router hears it."""
    outage = tmp_path / "outage"
    faults = {"unavailable_while": str(outage)}
    with _chain(tmp_path, "back", top_objects=2, faults=faults) as chain:
        removed: list[str] = []
        chain.watch_removals(removed.extend)
        outage.touch()
        keys = make_keys(5)
        stored = {k for k, ok in zip(keys, _put(chain, pool, keys)) if ok}
        chain.writer.flush(30)
        _wait_for(lambda: len(removed) >= 3)
        assert _router_view(stored, removed) == _content(chain, keys)
        assert set(removed) == set(keys[:3])  # the three evicted, held nowhere
