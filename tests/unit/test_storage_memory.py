"""The memory backend passes the storage contract; its capacity evicts LRU."""

from __future__ import annotations

import threading

from kvtier.memory.host import HostPool
from kvtier.storage import make_backend
from kvtier.storage.arena import ArenaStore
from kvtier.storage.memory import MemoryStore
from kvtier.testing.contract import CONTRACT_SPEC, StoreContract, expected_block, make_keys


class TestMemoryStore(StoreContract):
    def make_store(self, spec):
        return MemoryStore(spec)


def test_capacity_evicts_least_recently_used() -> None:
    store = MemoryStore(CONTRACT_SPEC, capacity_bytes=3 * (CONTRACT_SPEC.block_bytes + 64))
    keys = make_keys(4)
    with HostPool(CONTRACT_SPEC, 4) as pool:
        blocks = [pool.block(i) for i in range(4)]
        store.put_from(keys[:3], blocks[:3])
        store.get_into(keys[:1], blocks[3:])  # key 0 is now the most recent
        store.put_from(keys[3:], blocks[3:])
        assert [store.exists_prefix([k]) for k in keys] == [1, 0, 1, 1]
        assert store.stats.evictions == 1


class TestArenaStore(StoreContract):
    """The bounded memory backend: a preallocated slab of slots (the memory tier)."""

    def make_store(self, spec):
        return make_backend(spec, {"backend": "memory", "capacity_bytes": 64 * OBJECT_BYTES})


OBJECT_BYTES = CONTRACT_SPEC.block_bytes + 64


def test_the_bounded_memory_backend_preallocates_and_evicts_least_recently_used() -> None:
    store = make_backend(
        CONTRACT_SPEC, {"backend": "memory", "capacity_bytes": 3 * OBJECT_BYTES + 5}
    )
    assert isinstance(store, ArenaStore) and store.capacity_bytes == 3 * OBJECT_BYTES
    spilled = []
    store.watch_spills(spilled.extend)
    keys = make_keys(4)
    with HostPool(CONTRACT_SPEC, 4) as pool, store:
        blocks = [pool.block(i) for i in range(4)]
        for key, block in zip(keys, blocks):
            block.copy_(expected_block(key, block.numel()))
        store.put_from(keys[:3], blocks[:3])
        store.get_into(keys[:1], blocks[3:])  # key 0 is now the most recent
        store.put_from(keys[3:], blocks[3:])
        assert [store.exists_prefix([k]) for k in keys] == [1, 0, 1, 1]
        assert store.stats.evictions == 1 and store.usage().num_objects == 3
        assert [k for k, _ in spilled] == [keys[1]]  # handed over whole, header and all
        assert spilled[0][1][64:] == bytes(
            expected_block(keys[1], CONTRACT_SPEC.block_bytes).numpy()
        )


def test_a_slot_being_read_is_never_reused_by_a_save() -> None:
    """Saves that evict and loads that copy out, at once on one slot's worth of room: every
    load that reports True got exactly its key's bytes."""
    store = make_backend(CONTRACT_SPEC, {"backend": "memory", "capacity_bytes": 2 * OBJECT_BYTES})
    keys = make_keys(6)
    errors: list[BaseException] = []
    stop = threading.Event()
    with HostPool(CONTRACT_SPEC, 8) as pool, store:
        for i, key in enumerate(keys):
            pool.block(i).copy_(expected_block(key, CONTRACT_SPEC.block_bytes))

        def saver() -> None:
            while not stop.is_set():
                for i, key in enumerate(keys):
                    store.put_from([key], [pool.block(i)])

        def loader() -> None:
            try:
                for _ in range(300):
                    for key in keys:
                        target = pool.block(7)
                        if store.get_into([key], [target]) == [True]:
                            assert target.equal(expected_block(key, target.numel())), key
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=saver), threading.Thread(target=loader)]
        for thread in threads:
            thread.start()
        threads[1].join(120)
        stop.set()
        threads[0].join(120)
    assert not errors, errors[0]
    assert store.stats.corrupt == 0
