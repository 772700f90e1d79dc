"""The memory backend passes the storage contract; its capacity evicts LRU."""

from __future__ import annotations

from kvtier.host import HostPool
from kvtier.storage.memory import MemoryStore
from storage_contract import CONTRACT_SPEC, StoreContract, make_keys


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
