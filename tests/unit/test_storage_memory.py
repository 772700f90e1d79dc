"""The memory backend passes the storage contract; its capacity evicts LRU."""

from __future__ import annotations

import threading
from unittest import mock

import numpy as np
import pytest

from kvtier import KVCacheSpec
from kvtier.layout.checksum import payload_checksum
from kvtier.memory.host import HostPool
from kvtier.storage import Read, Verify, make_backend
from kvtier.storage.format import ObjectFormat
from kvtier.storage.memory.arena import ArenaStore
from kvtier.storage.memory.store import MemoryStore
from kvtier.testing.contract import CONTRACT_SPEC, StoreContract, expected_block, make_keys
from kvtier.testing.contract_base import reseal

CHECK_MAC = ObjectFormat._check_mac  # the real check, spied on (counted, still run)


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


def test_payloads_start_on_pages_and_objects_read_back_header_first() -> None:
    """Headers live apart from payloads, which start on pages (where blocks are whole pages:
    copies walk whole source pages); an object still reads and writes as one range of bytes."""
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, block_size=16, head_dim=32, num_blocks=1)
    assert spec.block_bytes % 4096 == 0
    store = make_backend(spec, {"backend": "memory", "capacity_bytes": 3 * (spec.block_bytes + 64)})
    keys = make_keys(2)
    with HostPool(spec, 1) as pool, store:
        assert [np.frombuffer(p, np.uint8).ctypes.data % 4096 for p in store._payloads] == [0] * 3
        block = pool.block(0)
        block.copy_(expected_block(keys[0], block.numel()))
        assert store.put_from(keys[:1], [block]) == [True]
        whole = store.read_object(keys[0])
        assert whole is not None and len(whole) == 64 + spec.block_bytes
        assert whole[64:] == bytes(block.numpy())
        store.write_object(keys[1], whole[:40])  # shorter than a header
        assert store.read_object(keys[1]) == whole[:40]
        store.write_object(keys[1], whole)  # its header names keys[0]: corrupt under keys[1]
        assert store.read_object(keys[1]) == whole
        block.zero_()
        assert store.get_into(keys, [block, pool.block(0)]) == [True, False]


@pytest.mark.parametrize("known", [False, True], ids=["hashed-here", "checksums-given"])
def test_a_batch_larger_than_the_store_keeps_its_last_objects_whole(known) -> None:
    """Ten saves in one call into three slots: the batch is copied in parts (slots taken before
    any is published), later parts evict earlier ones, and what stays is the last three, each
    with its own bytes and checksum."""
    store = make_backend(CONTRACT_SPEC, {"backend": "memory", "capacity_bytes": 3 * OBJECT_BYTES})
    keys = make_keys(10)
    with HostPool(CONTRACT_SPEC, 11) as pool, store:
        blocks = [pool.block(i) for i in range(10)]
        for key, block in zip(keys, blocks):
            block.copy_(expected_block(key, block.numel()))
        sums = [payload_checksum(block.numpy()) for block in blocks] if known else None
        assert store.put_from(keys, blocks, checksums=sums) == [True] * 10
        assert [store.exists_prefix([k]) for k in keys] == [0] * 7 + [1] * 3
        assert store.stats.evictions == 7
        target = pool.block(10)
        for key in keys[7:]:
            assert store.get_into([key], [target]) == [True]
            assert target.equal(expected_block(key, target.numel()))


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


@pytest.mark.parametrize("bounded", [False, True], ids=["MemoryStore", "ArenaStore"])
def test_a_memory_stores_own_objects_load_without_the_mac_planted_ones_with_it(bounded) -> None:
    """The MAC proves who wrote an object. A memory store's puts write this process's private
    memory, so a load of their objects skips the keyed BLAKE3 (a quarter of a memcpy's speed)
    and checks the checksum; an object that came through ``write_object`` — even a genuine one —
    is checked in full, and a forged one is refused."""
    mac_key = b"m" * 32
    if bounded:
        store = ArenaStore(CONTRACT_SPEC, 8 * OBJECT_BYTES, mac_key=mac_key)
    else:
        store = MemoryStore(CONTRACT_SPEC, mac_key=mac_key)
    keys = make_keys(3)
    with HostPool(CONTRACT_SPEC, 8) as pool, store:
        for key, i in zip(keys, range(3)):
            pool.block(i).copy_(expected_block(key, CONTRACT_SPEC.block_bytes))
        assert store.put_from(keys, [pool.block(i) for i in range(3)]) == [True] * 3
        want = [bytes(pool.block(i).numpy()) for i in range(3)]
        genuine = store.read_object(keys[1])
        forged = reseal(genuine, bytes(CONTRACT_SPEC.block_bytes))  # checksums made right
        spy = mock.patch.object(ObjectFormat, "_check_mac", autospec=True, side_effect=CHECK_MAC)
        with spy as check_mac:
            targets = [[memoryview(bytearray(CONTRACT_SPEC.block_bytes))] for _ in keys]
            assert store.get_into_scattered(keys, targets) == [True] * 3
            blocks = [pool.block(4 + i) for i in range(3)]
            read = Read(keys, blocks, Verify.CHECKSUM_BY_CALLER)
            assert store.read(read).found == [True] * 3
            assert check_mac.call_count == 0
        assert [bytes(t[0]) for t in targets] == want
        assert [bytes(b.numpy()) for b in blocks] == want
        with spy as check_mac:
            store.write_object(keys[1], genuine)
            assert store.get_into(keys[1:2], [pool.block(7)]) == [True]
            assert check_mac.call_count == 1 and bytes(pool.block(7).numpy()) == want[1]
            store.write_object(keys[2], forged)
            assert store.get_into(keys[2:3], [pool.block(7)]) == [False]


def test_a_slab_flip_fails_the_batch_at_that_object_and_the_rest_stays_out() -> None:
    """The memory tier's loads copy a batch in one pass and check each object after (its own
    headers parsed once, at the put): a payload byte flipped in the slab is a miss there, the
    object is removed, and a scattered read returns the prefix before it with every later
    target zeroed; a plain read answers the others."""
    store = ArenaStore(CONTRACT_SPEC, 8 * OBJECT_BYTES)
    keys = make_keys(4)
    size = CONTRACT_SPEC.block_bytes
    with HostPool(CONTRACT_SPEC, 8) as pool, store:
        for i, key in enumerate(keys):
            pool.block(i).copy_(expected_block(key, size))
        assert store.put_from(keys, [pool.block(i) for i in range(4)]) == [True] * 4
        want = [bytes(pool.block(i).numpy()) for i in range(4)]
        store._payloads[store._slots.of(keys[2])][size // 2] ^= 0x01  # a bit flips in memory
        targets = [
            [memoryview(bytearray(size // 2)), memoryview(bytearray(size // 2))] for _ in keys
        ]
        assert store.get_into_scattered(keys, targets) == [True, True, False, False]
        assert [b"".join(t) for t in targets[:2]] == want[:2]
        assert all(b"".join(t) == bytes(size) for t in targets[2:])
        assert store.stats.corrupt == 1 and store.exists_prefix(keys) == 2
        blocks = [pool.block(4 + i) for i in range(4)]
        assert store.get_into(keys, blocks) == [True, True, False, True]
        assert bytes(blocks[3].numpy()) == want[3]
        pool.block(2).copy_(expected_block(keys[2], size))  # saved again: a sound object
        assert store.put_from(keys[2:3], [pool.block(2)]) == [True]
        assert store.get_into(keys[2:3], blocks[2:3]) == [True]
        assert bytes(blocks[2].numpy()) == want[2]
