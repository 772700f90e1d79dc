"""The storage contract, what a backend refuses: flipped bits, bad headers, truncation, another
layout or key, wrong recorded checksums, and forgeries (with ``storage.mac_key_file``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.errors import ObjectCorrupt, StorageError
from kvtier.layout.checksum import payload_checksum
from kvtier.storage import HEADER_BYTES, ObjectFormat
from kvtier.storage.base import Read, Verify
from kvtier.testing.contract_base import (
    CONTRACT_SPEC,
    MAC_KEY,
    ContractBase,
    authenticated,
    expected_block,
    make_keys,
    reseal,
)


class IntegrityContract(ContractBase):
    """A damaged or forged object is a miss, counted, never served."""

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
        got = store.read(Read(keys, targets, Verify.CHECKSUM_BY_CALLER))
        assert got.found == [True, True, False] and got.checksums is not None
        sums = got.checksums
        actual = [payload_checksum(t.numpy()) for t in targets[:2]]
        assert int(sums[0]) == actual[0]  # intact: the caller's check passes
        assert int(sums[1]) != actual[1]  # damaged payload: the caller's check fails
        corrupt = store.stats.corrupt
        store.report_corrupt(keys[1], "payload checksum mismatch in the copy")
        assert store.stats.corrupt == corrupt + 1 and store.found_corrupt(keys[1])
        assert store.exists_prefix(keys[1:2]) == 0
        with pytest.raises(StorageError, match="3 keys but 2 host blocks"):
            store.read(Read(keys, targets[:2], Verify.CHECKSUM_BY_CALLER))

    def test_deferred_headers_leave_the_mac_to_the_caller(self, store, pool) -> None:
        """``Verify.ALL_BY_CALLER``: for loads into memory a peer can write (Mooncake's registered
        staging). The header is checked here (a bad one is a miss, as always); the payload and
        its MAC are not: the caller gets a private copy of the header and checks the bytes
        where it copied them (``format.check_deferred``)."""
        with authenticated(store, MAC_KEY):
            keys = make_keys(3)
            self.put(store, pool, keys)
            payload = bytearray(store.read_object(keys[1]))
            payload[HEADER_BYTES + 7] ^= 0x10  # the MAC no longer matches
            store.write_object(keys[1], bytes(payload))
            header = bytearray(store.read_object(keys[2]))
            header[9] ^= 0x01  # the fingerprint: caught here
            store.write_object(keys[2], bytes(header))
            targets = [pool.block(8 + i) for i in range(3)]
            got = store.read(Read(keys, targets, Verify.ALL_BY_CALLER))
            assert got.found == [True, True, False] and got.headers is not None
            headers = got.headers
            assert [len(h) if h else h for h in headers] == [HEADER_BYTES, HEADER_BYTES, None]
            check = store.format.check_deferred
            check(headers[0], keys[0], [targets[0].numpy().data])
            assert torch.equal(targets[0], expected_block(keys[0], CONTRACT_SPEC.block_bytes))
            with pytest.raises(ObjectCorrupt, match="MAC mismatch"):
                check(headers[1], keys[1], [targets[1].numpy().data])
            with pytest.raises(ObjectCorrupt, match="MAC mismatch"):  # another key's header
                check(headers[0], keys[1], [targets[0].numpy().data])
        plain = make_keys(1)  # without a MAC key the caller's check is the checksum
        self.put(store, pool, plain)
        got = store.read(Read(plain, targets[:1], Verify.ALL_BY_CALLER))
        assert got.found == [True] and got.headers is not None
        headers = got.headers
        store.format.check_deferred(headers[0], plain[0], [targets[0].numpy().data])
        targets[0][3] ^= 1
        with pytest.raises(ObjectCorrupt, match="checksum mismatch"):
            store.format.check_deferred(headers[0], plain[0], [targets[0].numpy().data])

    def test_a_put_makes_its_checks_over_the_originals(self, store, pool) -> None:
        """``originals``: the payload where no peer can write it, beside the registered block
        a peer wrote after the copy. The object's checksum and MAC come from the originals, so
        the peer's bytes are never served: a store that copies the payload from the originals
        serves them; one whose transfer reads the registered block (Mooncake) stores an object
        that fails its checks."""
        with authenticated(store, MAC_KEY):
            keys = make_keys(2)
            originals = [expected_block(k, CONTRACT_SPEC.block_bytes) for k in keys]
            blocks = [pool.block(i) for i in range(2)]
            for block, original in zip(blocks, originals):
                block.copy_(original)
            blocks[1][100] ^= 0x20  # the peer's write, after the copy
            views = [[o.numpy().data] for o in originals]
            assert store.put_from(keys, blocks, None, views) == [True, True]
            got = self.get(store, pool, keys)  # checks the bytes of what it loads
            assert got[0]
            if not got[1]:
                assert store.stats.corrupt >= 1 and store.exists_prefix(keys) == 1
            with pytest.raises(StorageError, match="2 keys but 1 targets"):
                store.put_from(make_keys(2), blocks, None, views[:1])

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
            blocks = [pool.block(8 + i) for i in range(5)]
            # The MAC is checked even when the payload checksum is left to the caller.
            got = store.read(Read(keys, blocks, Verify.CHECKSUM_BY_CALLER))
            assert got.found == [True, False, False, False, True]
            sums = got.checksums
            assert sums is not None and sums[0] == payload_checksum(blocks[0].numpy())
            io = store.scattered()
            if io is not None:
                stored = make_keys(1)
                self.put(store, pool, stored)
                target = [memoryview(bytearray(CONTRACT_SPEC.block_bytes))]
                assert io.get_into_scattered(stored, [target]) == [True]
                assert (
                    bytes(target[0])
                    == expected_block(stored[0], CONTRACT_SPEC.block_bytes).numpy().tobytes()
                )

    def test_a_reader_without_the_key_refuses_authenticated_objects(self, store, pool) -> None:
        keys = make_keys(1)
        with authenticated(store, MAC_KEY):
            self.put(store, pool, keys)
        assert self.get(store, pool, keys) == [False]
