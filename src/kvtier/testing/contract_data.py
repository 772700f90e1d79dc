"""The storage contract, what a backend stores: round trips, prefixes, deletes, usage,
scattered reads and writes, bad arguments, threads, two processes, persistence."""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any

import pytest
import torch

from kvtier.errors import StorageError
from kvtier.testing.contract_base import (
    CONTRACT_SPEC,
    ContractBase,
    expected_block,
    make_keys,
    store_round_trip,
)


class DataContract(ContractBase):
    """Stored bytes come back equal, in order, from any thread or process."""

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

    def test_scattered_reads_land_in_order_verified(self, store, pool) -> None:
        io = store.scattered()
        if io is None:
            pytest.skip(f"{store.kind} reads into host blocks only")
        keys = make_keys(3)
        self.put(store, pool, keys)
        pieces = [4096, CONTRACT_SPEC.block_bytes - 4096 - 100, 100]

        def targets(n: int) -> list[list[memoryview]]:
            return [[memoryview(bytearray(b"\xee" * k)) for k in pieces] for _ in range(n)]

        got = targets(3)
        assert io.get_into_scattered(keys, got) == [True] * 3
        for key, views in zip(keys, got):
            joined = b"".join(bytes(v) for v in views)
            assert joined == bytes(expected_block(key, CONTRACT_SPEC.block_bytes).numpy())
        missing = targets(1)
        assert io.get_into_scattered(make_keys(1), missing) == [False]
        assert all(bytes(v) == b"\xee" * len(v) for v in missing[0])  # untouched
        data = bytearray(store.read_object(keys[1]))
        data[-1] ^= 0x10  # only the payload check can see it
        store.write_object(keys[1], bytes(data))
        bad = targets(1)
        assert io.get_into_scattered(keys[1:2], bad) == [False]
        assert all(bytes(v) == bytes(len(v)) for v in bad[0])  # zeroed, never the failed bytes
        assert store.exists_prefix(keys[1:2]) == 0  # counted corrupt and removed
        with pytest.raises(StorageError):
            io.get_into_scattered(keys[:1], [])

    def test_scattered_reads_stop_at_the_first_miss(self, store, pool) -> None:
        """The data path reads a prefix: objects after a hole are not read (they were, and
        landed in device blocks past the reported prefix)."""
        io = store.scattered()
        if io is None:
            pytest.skip(f"{store.kind} reads into host blocks only")
        keys = make_keys(4)
        self.put(store, pool, [keys[0], keys[2], keys[3]])
        got = [[memoryview(bytearray(b"\xee" * CONTRACT_SPEC.block_bytes))] for _ in keys]
        assert io.get_into_scattered(keys, got) == [True, False, False, False]
        assert all(bytes(views[0]) == b"\xee" * CONTRACT_SPEC.block_bytes for views in got[1:])

    def test_a_scattered_read_writes_nothing_once_go_on_stops_it(self, store, pool) -> None:
        """``go_on`` is asked before any object lands in its targets (the worker's deadline:
        the engine may have reused those blocks); when it raises, no target is written and the
        exception reaches the caller; the objects stay stored."""
        io = store.scattered()
        if io is None:
            pytest.skip(f"{store.kind} reads into host blocks only")
        keys = make_keys(3)
        self.put(store, pool, keys)
        got = [[memoryview(bytearray(b"\xee" * CONTRACT_SPEC.block_bytes))] for _ in keys]
        asked: list[str] = []

        def stop(where: str) -> None:
            asked.append(where)
            raise TimeoutError(where)

        with pytest.raises(TimeoutError):
            io.get_into_scattered(keys, got, stop)
        assert asked and all(bytes(v[0]) == b"\xee" * CONTRACT_SPEC.block_bytes for v in got)
        assert io.get_into_scattered(keys, got, asked.append) == [True] * 3
        assert store.exists_prefix(keys) == 3

    def test_scattered_writes_store_the_pieces_in_order(self, store, pool) -> None:
        io = store.scattered()
        if io is None:
            pytest.skip(f"{store.kind} writes from host blocks only")
        keys = make_keys(2)
        payloads = [bytes(expected_block(k, CONTRACT_SPEC.block_bytes).numpy()) for k in keys]
        cut = [0, 1000, 5000, CONTRACT_SPEC.block_bytes]
        sources = [[memoryview(p)[a:b] for a, b in zip(cut, cut[1:])] for p in payloads]
        assert io.put_from_scattered(keys, sources) == [True, True]
        assert self.get(store, pool, keys) == [True, True]  # checksummed like any object
        assert io.put_from_scattered(keys, sources) == [True, True]  # stored: kept

    def test_bad_arguments(self, store, pool) -> None:
        keys = make_keys(2)
        with pytest.raises(StorageError, match="2 keys but 1 host blocks"):
            store.put_from(keys, [pool.block(0)])
        with pytest.raises(StorageError, match="need"):
            store.get_into(keys[:1], [pool.block(0)[:100]])

    def test_started_transfers_answer_once_as_put_from_and_read_do(self, store, pool) -> None:
        """Where a store moves bytes on its own threads (``starts_transfers``): ``done`` is
        called exactly once per transfer, off the caller's thread, with what ``put_from`` or
        ``read`` would answer (a stored key is kept; a missing and a corrupt object are misses,
        the rest byte-exact), counted like them."""
        starts = store.starts_transfers()
        if starts is None:
            pytest.skip(f"{store.kind} moves bytes only in read() and put_from()")
        calls: list[tuple] = []

        def run(start: Any, *args: Any) -> Any:
            answered = threading.Event()

            def done(result, error) -> None:
                calls.append((result, error, threading.current_thread()))
                answered.set()

            before = len(calls)
            start(*args, done)
            assert answered.wait(60), "a started transfer was never answered"
            result, error, thread = calls[-1]
            assert len(calls) == before + 1 and error is None
            assert thread is not threading.current_thread()
            return result

        keys = make_keys(6)
        written = [k for i, k in enumerate(keys) if i != 3]
        nbytes = CONTRACT_SPEC.block_bytes
        sources = [memoryview(bytes(expected_block(k, nbytes).numpy())) for k in written]
        puts = store.stats.puts
        assert run(starts.start_write, written, sources) == [True] * 5
        assert run(starts.start_write, written[:1], sources[1:2]) == [True]  # kept, not replaced
        assert store.stats.puts == puts + 6
        data = bytearray(store.read_object(keys[4]))
        data[-1] ^= 0x10  # only the payload check can see it
        store.write_object(keys[4], bytes(data))
        targets = [memoryview(bytearray(b"\xee" * nbytes)) for _ in keys]
        hits = store.stats.hits
        found = run(starts.start_read, keys, targets)
        assert found == [True, True, True, False, False, True]
        for key, target, ok in zip(keys, targets, found):
            if ok:
                assert bytes(target) == bytes(expected_block(key, nbytes).numpy()), key
        assert store.stats.hits == hits + 4
        with pytest.raises(StorageError, match="buffer 0"):
            starts.start_read(keys[:1], [memoryview(bytes(nbytes))], calls.append)  # read-only
        with pytest.raises(StorageError, match="2 keys but 1 buffers"):
            starts.start_write(keys[:2], sources[:1], calls.append)
        assert store.exists_prefix(keys[4:5]) == 0  # counted corrupt and removed

    def test_a_closed_store_starts_no_transfer(self, store, pool) -> None:
        """A closed store refuses to start a transfer and never calls its ``done``."""
        if store.starts_transfers() is None:
            pytest.skip(f"{store.kind} moves bytes only in read() and put_from()")
        closed = self.make_store(CONTRACT_SPEC)
        closed.close()
        refusing = closed.starts_transfers()
        assert refusing is not None
        calls: list[tuple] = []

        def record(result: Any, error: BaseException | None) -> None:
            calls.append((result, error))

        keys, buffers = make_keys(1), [memoryview(bytearray(CONTRACT_SPEC.block_bytes))]
        with pytest.raises(Exception):  # noqa: B017 - whatever the store raises once closed
            refusing.start_read(keys, buffers, record)
        with pytest.raises(Exception):  # noqa: B017
            refusing.start_write(keys, buffers, record)
        assert not calls

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
            target=store_round_trip,
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
