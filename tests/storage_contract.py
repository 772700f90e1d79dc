"""The storage contract suite: every backend's test class subclasses StoreContract.

A subclass provides ``make_store(spec)`` (a fresh backend over shared state per test, so a
second instance built the same way sees the same objects when the backend persists), and sets
``persistent`` / ``multi_process`` for what the backend promises.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import struct
import threading
import uuid

import numpy as np
import pytest
import torch
import xxhash

import procs
from kvtier.errors import StorageError
from kvtier.layout.checksum import payload_checksum
from kvtier.layout.keys import KeyScheme, block_hashes
from kvtier.layout.spec import KVCacheSpec
from kvtier.memory.host import HostPool
from kvtier.storage.base import StorageBackend
from kvtier.storage.format import HEADER_BYTES, ObjectFormat

# fp8 with scales: every backend must carry every part.
CONTRACT_SPEC = KVCacheSpec(
    num_layers=2, num_blocks=8, num_kv_heads=2, block_size=16, head_dim=64, dtype="block_wise_fp8"
)


def expected_block(key: str, nbytes: int) -> torch.Tensor:
    """The deterministic content stored under ``key`` in these tests."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def make_keys(n: int, namespace: str | None = None, rank: int = 0) -> list[str]:
    scheme = KeyScheme(
        namespace or f"test-{uuid.uuid4().hex[:8]}",
        CONTRACT_SPEC.fingerprint,
        rank=rank,
        version="RL-STEP1",
    )
    tokens = np.random.default_rng().integers(0, 150_000, n * CONTRACT_SPEC.block_size)
    return scheme.keys(block_hashes(tokens, CONTRACT_SPEC.block_size))


MAC_KEY = bytes(range(32))


@contextlib.contextmanager
def authenticated(store: StorageBackend, key: bytes | None):
    """The store reads and writes objects with ``key`` (None: plain objects) inside the block.

    The same switch ``storage.mac_key_file`` makes at construction; applied to a live store so
    that every backend (including class-scoped ones) runs the MAC tests.
    """
    stores = [store] + ([store.inner] if hasattr(store, "inner") else [])
    saved = [s.format for s in stores]
    for s in stores:
        s.format = ObjectFormat(s.fingerprint, key)
    try:
        yield store
    finally:
        for s, fmt in zip(stores, saved):
            s.format = fmt


def reseal(data: bytes, payload: bytes) -> bytes:
    """``data`` with its payload replaced by ``payload`` and every checksum made right again:
    what a writer who knows the format (but not a MAC key) can forge."""
    header = bytearray(data[:HEADER_BYTES])
    struct.pack_into("<Q", header, 40, xxhash.xxh3_64_intdigest(payload))
    struct.pack_into("<Q", header, 56, xxhash.xxh3_64_intdigest(bytes(header[:56])))
    return bytes(header) + payload + data[HEADER_BYTES + len(payload) :]  # the key trailer kept


class StoreContract:
    persistent = False
    multi_process = False

    def make_store(self, spec: KVCacheSpec) -> StorageBackend:
        raise NotImplementedError

    def store_config(self) -> dict:
        """A config another process can pass to make_backend to reach the same objects."""
        raise NotImplementedError

    @pytest.fixture
    def pool(self):
        with HostPool(CONTRACT_SPEC, 16) as pool:
            yield pool

    @pytest.fixture
    def store(self, pool):
        store = self.make_store(CONTRACT_SPEC)
        store.register_host_pool(pool)
        yield store
        store.close()

    # ---- helpers ----------------------------------------------------------------------------

    def put(self, store, pool, keys, first_block: int = 0) -> list[bool]:
        blocks = [pool.block(first_block + i) for i in range(len(keys))]
        for key, block in zip(keys, blocks):
            block.copy_(expected_block(key, block.numel()))
        return store.put_from(keys, blocks)

    def get(self, store, pool, keys, first_block: int = 8) -> list[bool]:
        blocks = [pool.block(first_block + i) for i in range(len(keys))]
        for block in blocks:
            block.fill_(0xEE)
        results = store.get_into(keys, blocks)
        for key, block, ok in zip(keys, blocks, results):
            if ok:
                assert torch.equal(block, expected_block(key, block.numel())), key
        return results

    # ---- the contract -----------------------------------------------------------------------

    def test_round_trip(self, store, pool) -> None:
        keys = make_keys(6)
        assert self.put(store, pool, keys) == [True] * 6
        assert self.get(store, pool, keys) == [True] * 6
        assert store.exists_prefix(keys) == 6

    def test_missing_is_a_miss(self, store, pool) -> None:
        keys = make_keys(3)
        assert store.exists_prefix(keys) == 0
        assert self.get(store, pool, keys) == [False] * 3
        assert store.exists_prefix([]) == 0
        assert store.get_into([], []) == [] and store.put_from([], []) == []

    def test_prefix_semantics(self, store, pool) -> None:
        keys = make_keys(6)
        stored = [keys[i] for i in (0, 1, 2, 4, 5)]  # a hole at 3
        assert all(self.put(store, pool, stored))
        assert store.exists_prefix(keys) == 3
        assert store.exists_prefix(keys[3:]) == 0  # first key missing
        assert store.exists_prefix(keys[4:]) == 2  # all present
        assert self.get(store, pool, keys) == [True, True, True, False, True, True]

    def test_put_of_existing_key_keeps_the_first_object(self, store, pool) -> None:
        keys = make_keys(1)
        assert self.put(store, pool, keys) == [True]
        pool.block(1).fill_(0x11)
        assert store.put_from(keys, [pool.block(1)]) == [True]
        assert self.get(store, pool, keys) == [True]  # still the first bytes

    def test_delete(self, store, pool) -> None:
        keys = make_keys(3)
        self.put(store, pool, keys)
        assert store.delete(keys[:2] + make_keys(1)) == 2
        assert store.exists_prefix(keys) == 0
        assert self.get(store, pool, keys) == [False, False, True]

    def test_usage_counts_objects(self, store, pool) -> None:
        before = store.usage()
        self.put(store, pool, make_keys(4))
        after = store.usage()
        assert after.num_objects == before.num_objects + 4
        assert after.used_bytes >= before.used_bytes + 4 * CONTRACT_SPEC.block_bytes

    @pytest.mark.parametrize(
        "where",
        [
            "magic",
            "fingerprint",
            "length",
            "checksum",
            "header_check",
            "payload_first",
            "payload_last",
        ],
    )
    def test_flipped_bit_is_a_miss(self, store, pool, where: str) -> None:
        offsets = {
            "magic": 0,
            "fingerprint": 9,
            "length": 33,
            "checksum": 41,
            "header_check": 60,
            "payload_first": HEADER_BYTES,
            "payload_last": HEADER_BYTES + CONTRACT_SPEC.block_bytes - 1,
        }
        keys = make_keys(3)
        self.put(store, pool, keys)
        data = bytearray(store.read_object(keys[1]))
        data[offsets[where]] ^= 0x08
        store.write_object(keys[1], bytes(data))
        corrupt_before = store.stats.corrupt
        assert self.get(store, pool, keys) == [True, False, True]
        assert store.stats.corrupt == corrupt_before + 1
        assert store.exists_prefix(keys) == 1  # removed: detected once, never served
        # A load that stopped there asks (and drops what it did not verify after it).
        assert store.found_corrupt(keys[1]) and not store.found_corrupt(keys[1])
        assert not store.found_corrupt(keys[0])

    header_checked_on_exists = True  # Mooncake answers existence from its master alone

    def test_an_object_with_a_bad_header_is_not_stored(self, store, pool) -> None:
        """Lookup and the write-through skip count only sound objects: a bad header is not
        "stored" (a save re-writes it) and lookup never claims more than a load can deliver."""
        if not self.header_checked_on_exists:
            pytest.skip(f"{store.kind} answers existence without reading the object")
        keys = make_keys(4)
        self.put(store, pool, keys)
        data = bytearray(store.read_object(keys[2]))
        data[20] ^= 0x01  # the key digest: the header no longer checks out
        store.write_object(keys[2], bytes(data))
        assert store.exists_prefix(keys) == 2
        assert self.put(store, pool, keys) == [True] * 4  # re-saved, not skipped
        assert store.exists_prefix(keys) == 4
        assert self.get(store, pool, keys) == [True] * 4

    def test_scattered_reads_land_in_order_verified(self, store, pool) -> None:
        if not store.supports_scattered_reads:
            pytest.skip(f"{store.kind} reads into host blocks only")
        keys = make_keys(3)
        self.put(store, pool, keys)
        pieces = [4096, CONTRACT_SPEC.block_bytes - 4096 - 100, 100]

        def targets(n: int) -> list[list[memoryview]]:
            return [[memoryview(bytearray(b"\xee" * k)) for k in pieces] for _ in range(n)]

        got = targets(3)
        assert store.get_into_scattered(keys, got) == [True] * 3
        for key, views in zip(keys, got):
            joined = b"".join(bytes(v) for v in views)
            assert joined == bytes(expected_block(key, CONTRACT_SPEC.block_bytes).numpy())
        missing = targets(1)
        assert store.get_into_scattered(make_keys(1), missing) == [False]
        assert all(bytes(v) == b"\xee" * len(v) for v in missing[0])  # untouched
        data = bytearray(store.read_object(keys[1]))
        data[-1] ^= 0x10  # only the payload check can see it
        store.write_object(keys[1], bytes(data))
        bad = targets(1)
        assert store.get_into_scattered(keys[1:2], bad) == [False]
        assert all(bytes(v) == bytes(len(v)) for v in bad[0])  # zeroed, never the failed bytes
        assert store.exists_prefix(keys[1:2]) == 0  # counted corrupt and removed
        with pytest.raises(StorageError):
            store.get_into_scattered(keys[:1], [])

    def test_scattered_reads_stop_at_the_first_miss(self, store, pool) -> None:
        """The data path reads a prefix: objects after a hole are not read (they were, and
        landed in device blocks past the reported prefix)."""
        if not store.supports_scattered_reads:
            pytest.skip(f"{store.kind} reads into host blocks only")
        keys = make_keys(4)
        self.put(store, pool, [keys[0], keys[2], keys[3]])
        got = [[memoryview(bytearray(b"\xee" * CONTRACT_SPEC.block_bytes))] for _ in keys]
        assert store.get_into_scattered(keys, got) == [True, False, False, False]
        assert all(bytes(views[0]) == b"\xee" * CONTRACT_SPEC.block_bytes for views in got[1:])

    def test_scattered_writes_store_the_pieces_in_order(self, store, pool) -> None:
        if not store.supports_scattered_reads:
            pytest.skip(f"{store.kind} writes from host blocks only")
        keys = make_keys(2)
        payloads = [bytes(expected_block(k, CONTRACT_SPEC.block_bytes).numpy()) for k in keys]
        cut = [0, 1000, 5000, CONTRACT_SPEC.block_bytes]
        sources = [[memoryview(p)[a:b] for a, b in zip(cut, cut[1:])] for p in payloads]
        assert store.put_from_scattered(keys, sources) == [True, True]
        assert self.get(store, pool, keys) == [True, True]  # checksummed like any object
        assert store.put_from_scattered(keys, sources) == [True, True]  # stored: kept

    def test_random_bit_flips_are_always_detected(self, store, pool) -> None:
        keys = make_keys(8)
        self.put(store, pool, keys[:8])
        rng = np.random.default_rng(7)
        for key in keys:
            data = bytearray(store.read_object(key))
            bit = int(rng.integers(len(data) * 8))
            data[bit // 8] ^= 1 << (bit % 8)
            store.write_object(key, bytes(data))
        assert self.get(store, pool, keys) == [False] * 8

    def test_truncated_object_is_a_miss(self, store, pool) -> None:
        keys = make_keys(2)
        self.put(store, pool, keys)
        store.write_object(keys[0], store.read_object(keys[0])[:-100])
        store.write_object(keys[1], store.read_object(keys[1])[: HEADER_BYTES - 1])
        assert self.get(store, pool, keys) == [False, False]

    def test_other_layout_or_other_key_is_a_miss(self, store, pool) -> None:
        keys = make_keys(3)
        self.put(store, pool, keys[:1])
        payload = expected_block(keys[1], CONTRACT_SPEC.block_bytes).numpy()
        other_fp = "0123456789abcdef"
        store.write_object(
            keys[1], ObjectFormat(other_fp).header(keys[1], [payload]) + payload.tobytes()
        )
        store.write_object(keys[2], store.read_object(keys[0]))  # the right bytes, wrong name
        assert self.get(store, pool, keys) == [True, False, False]

    def test_known_checksums_skip_hashing_and_still_protect(self, store, pool) -> None:
        keys = make_keys(3)
        blocks = [pool.block(i) for i in range(3)]
        for key, block in zip(keys, blocks):
            block.copy_(expected_block(key, block.numel()))
        right = [payload_checksum(b.numpy()) for b in blocks]
        assert store.put_from(keys, blocks, checksums=[right[0], None, right[2] ^ 1]) == [True] * 3
        # A wrong recorded checksum (stale pool metadata) can only cause a miss later.
        assert self.get(store, pool, keys) == [True, True, False]

    def test_deferred_verification_hands_on_the_stored_checksum(self, store, pool) -> None:
        keys = make_keys(3)
        self.put(store, pool, keys)
        payload = bytearray(store.read_object(keys[1]))
        payload[HEADER_BYTES + 5] ^= 0x40  # payload damage: only the caller's check can see it
        store.write_object(keys[1], bytes(payload))
        header = bytearray(store.read_object(keys[2]))
        header[20] ^= 0x01  # header damage: caught here as always
        store.write_object(keys[2], bytes(header))
        targets = [pool.block(8 + i) for i in range(3)]
        sums = np.zeros(3, dtype=np.uint64)
        assert store.get_into(keys, targets, checksums_out=sums) == [True, True, False]
        actual = [payload_checksum(t.numpy()) for t in targets[:2]]
        assert int(sums[0]) == actual[0]  # intact: the caller's check passes
        assert int(sums[1]) != actual[1]  # damaged payload: the caller's check fails
        corrupt = store.stats.corrupt
        store.report_corrupt(keys[1], "payload checksum mismatch in the copy")
        assert store.stats.corrupt == corrupt + 1 and store.found_corrupt(keys[1])
        assert store.exists_prefix(keys[1:2]) == 0
        with pytest.raises(StorageError, match="3 keys but 2 checksums"):
            store.get_into(keys, targets, checksums_out=sums[:2])

    def test_bad_arguments(self, store, pool) -> None:
        keys = make_keys(2)
        with pytest.raises(StorageError, match="2 keys but 1 host blocks"):
            store.put_from(keys, [pool.block(0)])
        with pytest.raises(StorageError, match="need"):
            store.get_into(keys[:1], [pool.block(0)[:100]])

    def test_concurrent_threads(self, store, pool) -> None:
        keys = make_keys(16)
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            try:
                mine = keys[i * 4 : i * 4 + 4]
                for _ in range(3):
                    # Each thread uses its own pair of host blocks (the caller's duty).
                    blocks = [pool.block(i * 2), pool.block(i * 2 + 1)]
                    for key in mine:
                        blocks[0].copy_(expected_block(key, blocks[0].numel()))
                        assert store.put_from([key], blocks[:1]) == [True]
                        blocks[1].fill_(0)
                        assert store.get_into([key], blocks[1:]) == [True]
                        assert torch.equal(blocks[1], blocks[0])
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors[0]
        assert store.exists_prefix(keys) == 16

    def test_two_processes(self, store, pool) -> None:
        if not self.multi_process:
            pytest.skip(f"{store.kind} objects live in one process")
        ours, theirs = make_keys(4), make_keys(4)
        self.put(store, pool, ours)
        ctx = mp.get_context("spawn")
        results, done = ctx.Queue(), ctx.Event()
        child = ctx.Process(
            target=procs.store_round_trip,
            args=(CONTRACT_SPEC.to_dict(), self.store_config(), theirs, ours, results, done),
        )
        child.start()
        try:
            # Both processes write at once.
            assert self.put(store, pool, make_keys(4), first_block=4) == [True] * 4
            put_ok, seen = results.get(timeout=120)
            assert put_ok == [True] * 4
            assert seen == [True] * 4  # the child read our objects, byte-exact
            assert self.get(store, pool, theirs) == [True] * 4  # and we read the child's
        finally:
            done.set()
            child.join(60)
        assert child.exitcode == 0

    def test_persistence_across_reopen(self, store, pool) -> None:
        if not self.persistent:
            pytest.skip(f"{store.kind} does not persist across close")
        keys = make_keys(3)
        self.put(store, pool, keys)
        store.close()
        reopened = self.make_store(CONTRACT_SPEC)
        reopened.register_host_pool(pool)
        try:
            assert reopened.exists_prefix(keys) == 3
            assert reopened.usage().num_objects >= 3
            assert self.get(reopened, pool, keys) == [True] * 3
        finally:
            reopened.close()

    # ---- authenticated objects (storage.mac_key_file) ---------------------------------------

    def test_a_forged_object_loads_unless_objects_are_authenticated(self, store, pool) -> None:
        """The attack: a writer of the store replaces a payload and fixes every checksum."""
        keys = make_keys(2)
        self.put(store, pool, keys)
        forged = reseal(store.read_object(keys[0]), bytes(CONTRACT_SPEC.block_bytes))
        store.write_object(keys[0], forged)
        blocks = [pool.block(8), pool.block(9)]
        assert store.get_into(keys, blocks) == [True, True]  # checksums alone cannot tell
        assert not torch.any(blocks[0])  # the forger's bytes were loaded as data

        with authenticated(store, MAC_KEY):
            keys = make_keys(2)
            self.put(store, pool, keys)
            assert self.get(store, pool, keys) == [True, True]
            store.write_object(
                keys[0],
                reseal(
                    store.read_object(keys[0]),
                    forged[HEADER_BYTES : HEADER_BYTES + CONTRACT_SPEC.block_bytes],
                ),
            )
            assert self.get(store, pool, keys) == [False, True]

    def test_authenticated_stores_refuse_every_kind_of_forgery(self, store, pool) -> None:
        with authenticated(store, MAC_KEY):
            keys = make_keys(5)
            self.put(store, pool, keys)
            payload = expected_block(keys[1], CONTRACT_SPEC.block_bytes).numpy()
            plain = ObjectFormat(CONTRACT_SPEC.fingerprint)  # a writer without the key
            other = ObjectFormat(CONTRACT_SPEC.fingerprint, b"k" * 32)  # with another key
            store.write_object(keys[1], plain.header(keys[1], [payload]) + payload.tobytes())
            store.write_object(keys[2], other.header(keys[2], [payload]) + payload.tobytes())
            store.write_object(keys[3], store.read_object(keys[4]))  # a sound object, renamed
            sums = np.zeros(5, dtype=np.uint64)
            blocks = [pool.block(8 + i) for i in range(5)]
            # The MAC is checked even when the payload checksum is left to the caller.
            assert store.get_into(keys, blocks, checksums_out=sums) == [
                True,
                False,
                False,
                False,
                True,
            ]
            assert sums[0] == payload_checksum(blocks[0].numpy())
            if store.supports_scattered_reads:
                stored = make_keys(1)
                self.put(store, pool, stored)
                target = [memoryview(bytearray(CONTRACT_SPEC.block_bytes))]
                assert store.get_into_scattered(stored, [target]) == [True]
                assert (
                    bytes(target[0])
                    == expected_block(stored[0], CONTRACT_SPEC.block_bytes).numpy().tobytes()
                )

    def test_a_reader_without_the_key_refuses_authenticated_objects(self, store, pool) -> None:
        keys = make_keys(1)
        with authenticated(store, MAC_KEY):
            self.put(store, pool, keys)
        assert self.get(store, pool, keys) == [False]
