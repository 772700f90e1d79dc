"""The worker's parts in one process, with real objects and no sockets: Gate, aggregate,
DataPath, ControlPlane, and a Worker and Client over the in-process ``local://`` transport.

Fast (no process start): the process tests stay for what only processes show.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid

import msgspec
import numpy as np
import pytest
import torch

from conftest import fill_random
from kvtier.engine.client import Client, aggregate
from kvtier.errors import DeadlinePassed, InvalidBlockHash, InvalidBlockIds
from kvtier.layout.keys import KeyScheme, block_hashes
from kvtier.memory.device import DeviceCache, cache_name
from kvtier.memory.host import HostLayout, HostPool
from kvtier.storage import make_backend
from kvtier.storage.chain.store import TieredStore
from kvtier.storage.format import HEADER_BYTES
from kvtier.storage.memory.store import MemoryStore
from kvtier.testing.contract import MAC_KEY
from kvtier.transport import tasks as t
from kvtier.transport.local import LocalClient
from kvtier.worker import deadline
from kvtier.worker.config import WorkerConfig
from kvtier.worker.control_plane import Answer, ControlPlane
from kvtier.worker.datapath import DataPath
from kvtier.worker.gate import Gate, Refusal, WorkerState
from kvtier.worker.resources import RankResources
from kvtier.worker.routes import StagedRoute
from worker_helpers import (
    WSPEC,
    HostBlocksOnlyStore,
    PeerWritableStore,
    block,
    local_worker,
    same,
)


def hashes(n: int, seed: int = 0) -> list[bytes]:
    tokens = np.random.default_rng(seed).integers(0, 50_000, n * WSPEC.block_size)
    return block_hashes(tokens, WSPEC.block_size)


# ---- Gate -------------------------------------------------------------------------------------


def test_gate_holds_in_order_and_refuses_by_state() -> None:
    gate, ran = Gate(), []
    assert gate.admit("a", ran.append) is None and ran == ["a"]
    gate.set_state(WorkerState.PAUSED)
    for item in "bcd":
        assert gate.admit(item, ran.append) is None
    assert ran == ["a"] and gate.held == 3
    assert gate.resume(ran.append) == 3 and ran == list("abcd")
    assert gate.in_flight == 4
    gate.done(*"abcd")
    assert gate.wait_idle(0.1)
    gate.set_state(WorkerState.SLEEPING)
    assert gate.admit("e", ran.append) is Refusal.SLEEPING
    gate.set_state(WorkerState.WAKING)  # a wakeup under way holds, like a pause
    assert gate.admit("f", ran.append) is None and gate.held == 1
    gate.set_state(WorkerState.STOPPING)
    assert gate.admit("g", ran.append) is Refusal.STOPPING
    assert gate.take_held() == ["f"]


# ---- aggregate --------------------------------------------------------------------------------


def test_aggregate_takes_the_shortest_prefix_and_the_worst_status() -> None:
    task = t.Load(task_id=7, block_hashes=hashes(3), device_block_ids=[1, 2, 3])
    results = {
        0: t.Result(task_id=7, status=t.Status.OK, blocks=[1, 2, 3], bytes_moved=30, rank=0),
        1: t.Result(
            task_id=7, status=t.Status.PARTIAL, blocks=[1], bytes_moved=10, message="x", rank=1
        ),
    }
    out = aggregate(task, results)
    assert (out.status, out.blocks, out.bytes_moved) == (t.Status.PARTIAL, [1], 40)
    assert out.message == "rank 1: x"
    control = aggregate(
        t.Control(task_id=8, method="pause"),
        {
            0: t.Result(task_id=8, status=t.Status.OK, code=t.Code.OK),
            1: t.Result(task_id=8, status=t.Status.ERROR, code=t.Code.CONFLICT),
        },
    )
    assert control.code is t.Code.CONFLICT


def test_a_lookups_tiers_are_the_slowest_ranks_over_the_blocks_every_rank_holds() -> None:
    task = t.Lookup(task_id=9, block_hashes=hashes(4))
    answer = {
        0: t.Result(task_id=9, status=t.Status.OK, count=4, tiers=bytes([0, 1, 0, 1])),
        1: t.Result(task_id=9, status=t.Status.OK, count=3),  # all from its first tier
        2: t.Result(task_id=9, status=t.Status.OK, count=4, tiers=bytes([0, 0, 2, 0])),
    }
    out = aggregate(task, answer)
    assert (out.count, out.tiers) == (3, bytes([0, 1, 2]))
    plain = {r: t.Result(task_id=9, status=t.Status.OK, count=2) for r in range(2)}
    assert aggregate(task, plain).tiers == b""


def test_one_ranks_answer_aggregates_as_two_identical_ranks_would() -> None:
    """The one-rank shortcut gives what the general fan-in gives (a second rank answering
    the same, message aside), field for field."""
    task = t.Lookup(task_id=11, block_hashes=hashes(3))
    one = t.Result(
        task_id=11,
        status=t.Status.PARTIAL,
        blocks=[4, 5],
        count=3,
        bytes_moved=64,
        seconds=0.25,
        message="short",
        code=t.Code.CONFLICT,
        rank=0,
        removed=[b"a" * 16, b"b" * 16, b"a" * 16],
        all_removed=True,
        tiers=bytes([0, 2, 1, 1]),
    )
    twin = msgspec.structs.replace(one, rank=1, message="", bytes_moved=0)
    alone, general = aggregate(task, {0: one}), aggregate(task, {0: one, 1: twin})
    assert msgspec.structs.asdict(alone) == msgspec.structs.asdict(general)
    assert alone.message == "rank 0: short" and alone.rank == -1 and alone.tiers == bytes([0, 2, 1])
    quiet = aggregate(task, {0: t.Result(task_id=11, status=t.Status.OK, rank=0)})
    assert (quiet.message, quiet.removed, quiet.tiers, quiet.task_id) == ("", [], b"", 11)


# ---- DataPath ---------------------------------------------------------------------------------


def _store_for(route: str):
    if route == "mixed":  # memory over a tier that reads into host blocks only (as Mooncake)
        return TieredStore([MemoryStore(WSPEC), HostBlocksOnlyStore(WSPEC)])
    if route.startswith("peer"):  # Mooncake's kind: staging its peers can write; MACs on
        if route == "peer-mixed":
            tiers = [MemoryStore(WSPEC), PeerWritableStore(WSPEC)]
            return TieredStore(tiers, mac_key=MAC_KEY)
        return PeerWritableStore(WSPEC, mac_key=MAC_KEY)
    return (MemoryStore if route == "direct" else HostBlocksOnlyStore)(WSPEC)


# peer-*: the store's peers can write the staging (Mooncake): loads are checked and saves
# MACed in private host blocks on their way.
@pytest.fixture(params=["direct", "staged", "mixed", "peer-staged", "peer-mixed"])
def datapath(request):
    layout = HostLayout(engine_blocks=8, staging_blocks=2)
    name = cache_name(f"dp{uuid.uuid4().hex[:8]}", 0)
    with DeviceCache.create(WSPEC, name) as cache, HostPool(WSPEC, layout.total_blocks) as pool:
        fill_random(cache, 1)
        path = DataPath(cache, pool, layout, _store_for(request.param))
        # Chosen once, when the path is built: a mixed chain reads its top tier directly.
        mixed = request.param.endswith("mixed")
        assert path.route.name == (
            "direct" if mixed else "staged" if "-" in request.param else request.param
        )
        assert (getattr(path.route, "below", None) is not None) == mixed
        staged = path.route.below if mixed else path.route
        if isinstance(staged, StagedRoute):
            assert staged.peers_write_staging == request.param.startswith("peer")
        if isinstance(staged, StagedRoute):  # where peers write the staging: private blocks
            assert (staged.private is not None) == staged.peers_write_staging
        yield path, cache, KeyScheme("m", WSPEC.fingerprint, 0, "v1")
        path.close()
        for private in getattr(staged, "private", None), getattr(staged, "private_save", None):
            assert private is None or private.pool.flat.numel() == 0  # freed with the path


def test_a_chain_loads_its_top_tiers_blocks_directly_and_the_rest_through_staging() -> None:
    """Memory over a tier that reads into host blocks only (Mooncake's kind): the blocks the
    memory tier holds go straight into the device blocks, the others through the 2-block
    staging from the tier below (promoted on the way), in one load, every byte right. Before,
    such a chain took the staged route for every block: two copies for a memory hit."""
    layout = HostLayout(engine_blocks=8, staging_blocks=2)
    name = cache_name(f"dp{uuid.uuid4().hex[:8]}", 0)
    store = _store_for("mixed")
    with DeviceCache.create(WSPEC, name) as cache, HostPool(WSPEC, layout.total_blocks) as pool:
        fill_random(cache, 1)
        path, h = DataPath(cache, pool, layout, store), hashes(6)
        keys = KeyScheme("m", WSPEC.fingerprint, 0, "v1")
        assert path.route.name == "direct"
        want = [block(cache, b) for b in range(6)]
        assert path.run(t.Save(block_hashes=h, device_block_ids=list(range(6))), keys).blocks
        assert store.writer is not None and store.writer.flush(30) == 0  # written through
        below = store.tiers[1]
        assert below.exists_prefix(keys.keys(h)) == 6
        store.tiers[0].delete(keys.keys(h[2:5]))  # only the tier below holds blocks 2-4
        reads = []
        read = below.read
        below.read = lambda request: reads.append(len(request.keys)) or read(request)
        dev = [20, 21, 22, 23, 24, 25]
        loaded = path.run(t.Load(block_hashes=h, device_block_ids=dev), keys)
        assert loaded.status is t.Status.OK and loaded.blocks == dev
        assert all(same(block(cache, d), want[i]) for i, d in enumerate(dev))
        assert reads == [2, 1]  # blocks 2-4 from below, a staging's worth at a time
        assert store.tiers[0].exists_prefix(keys.keys(h)) == 6  # promoted
        # Nothing below either: the load stops there and leaves the later device blocks alone.
        store.delete(keys.keys(h[3:4]))
        before = [block(cache, 10 + i) for i in range(6)]
        hole = path.run(t.Load(block_hashes=h, device_block_ids=list(range(10, 16))), keys)
        assert hole.status is t.Status.PARTIAL and hole.blocks == [10, 11, 12]
        assert all(same(block(cache, 13 + i), before[3 + i]) for i in range(3))
        path.close()


def test_a_block_bad_in_memory_but_sound_below_leaves_no_mark_that_drops_others_later() -> None:
    """Memory over a tier below: the memory tier's copy of block 1 fails its check, so the
    load reads it from below (every byte right). The memory tier's "found corrupt" mark for it
    is stale then; before, it stayed, and a later load that stopped at block 1 for a plain miss
    took it for a bad object and deleted the sound objects after it."""
    layout = HostLayout(engine_blocks=8, staging_blocks=2)
    name = cache_name(f"dp{uuid.uuid4().hex[:8]}", 0)
    store = _store_for("mixed")
    with DeviceCache.create(WSPEC, name) as cache, HostPool(WSPEC, layout.total_blocks) as pool:
        fill_random(cache, 4)
        path, h = DataPath(cache, pool, layout, store), hashes(4, seed=41)
        keys = KeyScheme("m", WSPEC.fingerprint, 0, "v1")
        names = keys.keys(h)
        want = [block(cache, b) for b in range(4)]
        assert path.run(t.Save(block_hashes=h, device_block_ids=[0, 1, 2, 3]), keys).blocks
        assert store.writer is not None and store.writer.flush(30) == 0
        data = bytearray(store.tiers[0].read_object(names[1]))
        data[HEADER_BYTES + 9] ^= 0x04
        store.tiers[0].write_object(names[1], bytes(data))
        loaded = path.run(t.Load(block_hashes=h, device_block_ids=[20, 21, 22, 23]), keys)
        assert loaded.status is t.Status.OK
        assert all(same(block(cache, 20 + i), want[i]) for i in range(4))
        store.delete(names[1:2])  # now a plain hole
        hole = path.run(t.Load(block_hashes=h, device_block_ids=[24, 25, 26, 27]), keys)
        assert hole.blocks == [24]
        assert store.tiers[1].exists_prefix(names[2:]) == 2  # the sound ones after it stay
        path.close()


def test_datapath_saves_and_loads_real_bytes_on_either_route(datapath) -> None:
    """Through staging (2 blocks: several steps) or straight into the device blocks."""
    path, cache, keys = datapath
    h = hashes(5)  # more than the 2 staging blocks: several steps
    want = [block(cache, b) for b in range(5)]
    saved = path.run(t.Save(block_hashes=h, device_block_ids=[0, 1, 2, 3, 4]), keys)
    assert saved.blocks == [0, 1, 2, 3, 4] and saved.bytes_moved == 5 * WSPEC.block_bytes
    again = path.run(t.Save(block_hashes=h, device_block_ids=[0, 1, 2, 3, 4]), keys)
    assert again.bytes_moved == 0  # the stored prefix is skipped: nothing moved
    loaded = path.run(t.Load(block_hashes=h, device_block_ids=[30, 31, 32, 33, 34]), keys)
    assert loaded.blocks == [30, 31, 32, 33, 34]
    assert all(same(block(cache, 30 + i), want[i]) for i in range(5))
    other = keys.with_version("v2")
    assert path.run(t.Lookup(block_hashes=h), other).count == 0  # keys are per task
    # A hole: the load stops there, and nothing after it lands in the device blocks.
    path.storage.delete(keys.keys(h[2:3]))
    before = [block(cache, 20 + i) for i in range(5)]
    hole = path.run(t.Load(block_hashes=h, device_block_ids=[20, 21, 22, 23, 24]), keys)
    assert hole.status is t.Status.PARTIAL and hole.blocks == [20, 21]
    assert all(same(block(cache, 22 + i), before[2 + i]) for i in range(3))


def test_a_load_asks_the_store_for_its_objects_without_an_existence_pass(datapath) -> None:
    """The scheduler looked the blocks up just before: a load goes straight to the objects (an
    existence pass was one more round trip to the store per load); a miss still ends it."""
    path, cache, keys = datapath
    h = hashes(5, seed=9)
    path.run(t.Save(block_hashes=h, device_block_ids=[0, 1, 2, 3, 4]), keys)
    asked = []
    exists = path.storage.exists_prefix
    path.storage.exists_prefix = lambda ks: asked.append(len(ks)) or exists(ks)
    loaded = path.run(t.Load(block_hashes=h, device_block_ids=[30, 31, 32, 33, 34]), keys)
    missing = path.run(t.Load(block_hashes=hashes(3, seed=10), device_block_ids=[5, 6, 7]), keys)
    assert loaded.blocks == [30, 31, 32, 33, 34] and asked == []
    assert missing.status is t.Status.PARTIAL and missing.blocks == [] and asked == []


def test_a_prefix_with_bad_objects_is_whole_after_one_save_on_either_route(datapath) -> None:
    """Payload bit rot in every object but the first (headers sound): the load stops at the
    first bad one and drops the unverified ones after it, so the caller's save of the
    recomputed blocks writes them all again and the next load gets the whole prefix. (A put
    keeps a stored object whose header is sound: before, a save repaired one block per run —
    vLLM's restarted engine found the next bad block each time.)"""
    path, cache, keys = datapath
    h = hashes(5, seed=3)
    want = [block(cache, b) for b in range(5)]
    path.run(t.Save(block_hashes=h, device_block_ids=[0, 1, 2, 3, 4]), keys)
    for key in keys.keys(h[1:]):
        data = bytearray(path.storage.read_object(key))
        data[HEADER_BYTES] ^= 0x01  # the payload's first byte
        path.storage.write_object(key, bytes(data))
    bad = path.run(t.Load(block_hashes=h, device_block_ids=[20, 21, 22, 23, 24]), keys)
    assert bad.blocks == [20] and path.storage.stats.corrupt == 1
    assert path.storage.exists_prefix(keys.keys(h)) == 1  # the unverified ones are gone too
    resaved = path.run(t.Save(block_hashes=h, device_block_ids=[0, 1, 2, 3, 4]), keys)
    assert resaved.blocks == [0, 1, 2, 3, 4] and resaved.count == 1  # the first was sound
    whole = path.run(t.Load(block_hashes=h, device_block_ids=[30, 31, 32, 33, 34]), keys)
    assert whole.blocks == [30, 31, 32, 33, 34]
    assert all(same(block(cache, 30 + i), want[i]) for i in range(5))
    # A plain miss (a hole) drops nothing after it: those objects may be sound.
    path.storage.delete(keys.keys(h[2:3]))
    hole = path.run(t.Load(block_hashes=h, device_block_ids=[20, 21, 22, 23, 24]), keys)
    assert hole.blocks == [20, 21] and path.storage.read_object(keys.keys(h[3:4])[0])


def test_a_save_and_a_load_check_their_device_ids_once_on_either_route(datapath) -> None:
    """The data path checks a task's ids once; the route's copies and pieces trust them (a
    load of 5 blocks through 2 staging blocks used to check them again at every step)."""
    from unittest import mock

    import kvtier.memory.copier_base as copier_module

    path, _, keys = datapath
    h = hashes(5)
    with mock.patch.object(
        copier_module, "check_block_ids", wraps=copier_module.check_block_ids
    ) as checks:
        path.run(t.Save(block_hashes=h, device_block_ids=[0, 1, 2, 3, 4]), keys)
        assert checks.call_count == 1
        checks.reset_mock()
        loaded = path.run(t.Load(block_hashes=h, device_block_ids=[30, 31, 32, 33, 34]), keys)
        assert loaded.blocks == [30, 31, 32, 33, 34]
        assert checks.call_count == 1
    with pytest.raises(InvalidBlockIds, match="appears twice"):  # and that one check holds
        path.run(t.Load(block_hashes=h[:2], device_block_ids=[30, 30]), keys)


def test_a_task_past_its_cutoff_leaves_its_device_blocks_alone_on_either_route(datapath) -> None:
    """Once the client may have given up (``kvtier.worker.deadline``) a save reads no device
    block and a load writes none: on the staged route also when the store's transfer ran past
    the cutoff (the check sits between the transfer and the copy)."""
    path, cache, keys = datapath
    h = hashes(4, seed=12)
    passed = time.monotonic() - 1.0
    with pytest.raises(DeadlinePassed, match="before reading .*device blocks"):
        path.run(t.Save(block_hashes=h, device_block_ids=[0, 1, 2, 3], timeout_ms=1), keys, passed)
    assert path.storage.exists_prefix(keys.keys(h)) == 0
    assert path.run(t.Save(block_hashes=h, device_block_ids=[0, 1, 2, 3]), keys).blocks
    before = [block(cache, b) for b in (20, 21, 22, 23)]
    load = t.Load(block_hashes=h, device_block_ids=[20, 21, 22, 23], timeout_ms=1)
    with pytest.raises(DeadlinePassed):
        path.run(load, keys, passed)
    if path.route.name == "staged":
        read = path.storage.read

        def slow_read(request):  # the store answers after the cutoff
            time.sleep(0.3)
            return read(request)

        path.storage.read = slow_read
        with pytest.raises(DeadlinePassed, match="after its transfer from the store"):
            path.run(load, keys, time.monotonic() + 0.1)
    assert all(same(block(cache, 20 + i), before[i]) for i in range(4))


@contextlib.contextmanager
def _macs_over(blocks: list[int]):
    """Yields the list of MAC computations (made or checked) over memory inside any of the
    blocks starting at ``blocks`` (addresses), gathered until the block exits, and how many
    MACs were computed at all."""
    from unittest import mock

    from kvtier.storage.format import ObjectFormat

    inside: list[int] = []
    counted = [0]
    mac = ObjectFormat._mac

    def spy(fmt, body, key, payload):
        counted[0] += 1
        for view in payload:
            address = np.frombuffer(view, dtype=np.uint8).ctypes.data
            inside.extend(a for a in blocks if a <= address < a + WSPEC.block_bytes)
        return mac(fmt, body, key, payload)

    with mock.patch.object(ObjectFormat, "_mac", autospec=True, side_effect=spy):
        yield inside, counted


def _peer_store(datapath):
    """(path, cache, keys, the chain or store, the tier whose staging peers write), or a skip
    where the staging is private."""
    path, cache, keys = datapath
    chain = isinstance(path.storage, TieredStore)
    staged = path.route.below if chain else path.route
    if not getattr(staged, "peers_write_staging", False):
        pytest.skip("this store's staging is private memory")
    store = path.storage
    return path, cache, keys, store, store.tiers[1] if chain else store


def test_a_peer_writing_the_staging_never_gets_its_bytes_into_the_device_or_memory(
    datapath,
) -> None:
    """Mooncake lets any peer of the cluster write registered memory, the worker's staging
    included. A peer that writes a block there after the store has checked it (here: as
    ``get_into`` answers) gets none of its bytes into the engine's cache or the memory tier:
    every MAC of the load is checked where the bytes landed, never in the staging (before, the
    MAC was checked in the staging and the copy that followed trusted an XXH3, no MAC); the
    block that fails is scrubbed, counted and removed, the blocks before it load, and a chain
    promotes only those."""
    path, cache, keys, store, lower = _peer_store(datapath)
    chain = store is not lower
    h = hashes(5, seed=31)
    names = keys.keys(h)
    want = [block(cache, b) for b in range(5)]
    assert path.run(t.Save(block_hashes=h, device_block_ids=[0, 1, 2, 3, 4]), keys).blocks
    if chain:
        assert store.writer.flush(30) == 0
        store.tiers[0].delete(names)  # every block from the cluster, through the staging
    lower.peer = lambda key, host_block: key == names[2] and host_block.fill_(0xAB)
    staging = [path.host_pool.block(int(i)).data_ptr() for i in path.layout.load_staging]
    with _macs_over(staging) as (in_staging, macs):
        loaded = path.run(t.Load(block_hashes=h, device_block_ids=[20, 21, 22, 23, 24]), keys)
    assert loaded.status is t.Status.PARTIAL and loaded.blocks == [20, 21]
    assert all(same(block(cache, 20 + i), want[i]) for i in range(2))
    assert not any(torch.all(piece == 0xAB) for piece in block(cache, 22))
    assert store.stats.corrupt == 1 and store.exists_prefix(names) == 2
    assert macs[0] and not in_staging
    if chain:  # promoted: the two that passed, not the forged one
        assert store.tiers[0].exists_prefix(names) == 2
        assert store.tiers[0].exists_prefix(names[2:3]) == 0


def test_a_peer_writing_the_save_staging_never_gets_its_bytes_stored_under_a_valid_mac(
    datapath,
) -> None:
    """The other direction: a save reaches Mooncake through registered memory (the save
    staging; a chain's writer ring). A peer that writes a block there before the transfer
    reads it gets an object stored that fails its MAC — the checksum and MAC are made over the
    device block (or a private copy), never over the registered block (before, the MAC was made
    over the staging: it vouched for the peer's bytes). The load stops there."""
    path, cache, keys, store, lower = _peer_store(datapath)
    chain = store is not lower
    h = hashes(5, seed=35)
    names = keys.keys(h)
    want = [block(cache, b) for b in range(5)]
    lower.peer_on_put = lambda key, host_block: key == names[2] and host_block.fill_(0xAB)
    registered = [path.host_pool.block(int(i)).data_ptr() for i in path.layout.save_staging]
    if chain:
        ring = store.writer._ring
        registered += [ring.block(i).data_ptr() for i in range(ring.num_blocks)]
    with _macs_over(registered) as (in_registered, macs):
        saved = path.run(t.Save(block_hashes=h, device_block_ids=[0, 1, 2, 3, 4]), keys)
        assert saved.blocks == [0, 1, 2, 3, 4]
        if chain:
            assert store.writer.flush(30) == 0
    assert macs[0] and not in_registered
    if chain:
        store.tiers[0].delete(names)  # every block from below
    loaded = path.run(t.Load(block_hashes=h, device_block_ids=[20, 21, 22, 23, 24]), keys)
    assert loaded.blocks == [20, 21]
    assert all(same(block(cache, 20 + i), want[i]) for i in range(2))
    assert not any(torch.all(piece == 0xAB) for piece in block(cache, 22))
    assert store.stats.corrupt == 1


def test_a_host_load_through_staging_a_peer_can_write_is_checked_in_the_engines_block() -> None:
    """``load_host`` with Mooncake's kind of store goes through the registered staging too:
    each block is checked in the engine's host block it was copied to (before, it was checked
    in the staging and then copied unchecked); one that fails is zeroed there and ends the
    load, and a save of the blocks again makes the prefix whole."""
    layout = HostLayout(engine_blocks=8, staging_blocks=2)
    name = cache_name(f"dp{uuid.uuid4().hex[:8]}", 0)
    store = PeerWritableStore(WSPEC, mac_key=MAC_KEY)
    with DeviceCache.create(WSPEC, name) as cache, HostPool(WSPEC, layout.total_blocks) as pool:
        path, h = DataPath(cache, pool, layout, store), hashes(4, seed=33)
        keys = KeyScheme("m", WSPEC.fingerprint, 0, "v1")
        gen = torch.Generator().manual_seed(5)
        for i in range(4):
            random = torch.randint(0, 256, (WSPEC.block_bytes,), dtype=torch.uint8, generator=gen)
            pool.block(i).copy_(random)
        want = [pool.block(i).clone() for i in range(4)]
        assert path.run(t.SaveHost(block_hashes=h, host_block_ids=[0, 1, 2, 3]), keys).blocks
        forged = keys.keys(h)[1]
        store.peer = lambda key, host_block: key == forged and host_block.fill_(0xAB)
        bad = path.run(t.LoadHost(block_hashes=h, host_block_ids=[4, 5, 6, 7]), keys)
        assert bad.status is t.Status.PARTIAL and bad.blocks == [4]
        assert torch.equal(pool.block(4), want[0]) and not torch.any(pool.block(5))
        assert store.stats.corrupt == 1 and store.exists_prefix(keys.keys(h)) == 1
        store.peer = None
        assert path.run(t.SaveHost(block_hashes=h, host_block_ids=[0, 1, 2, 3]), keys).blocks
        whole = path.run(t.LoadHost(block_hashes=h, host_block_ids=[4, 5, 6, 7]), keys)
        assert whole.blocks == [4, 5, 6, 7]
        assert all(torch.equal(pool.block(4 + i), want[i]) for i in range(4))
        path.close()


def test_a_direct_load_from_a_stalled_disk_reads_no_object_past_the_cutoff(tmp_path) -> None:
    """The direct route reads objects straight into device blocks. A disk that stalls on one
    object's read past the task's cutoff: that read (already in the kernel) lands, and no
    later object is read into its block: the engine may have given those blocks to another
    request by then. (Before, the whole task's reads went on after the stall.)"""
    layout = HostLayout(engine_blocks=8, staging_blocks=2)
    name = cache_name(f"dp{uuid.uuid4().hex[:8]}", 0)
    store = make_backend(WSPEC, {"backend": "file", "root": str(tmp_path / "store")})
    with DeviceCache.create(WSPEC, name) as cache, HostPool(WSPEC, layout.total_blocks) as pool:
        fill_random(cache, 1)
        path = DataPath(cache, pool, layout, store)
        assert path.route.name == "direct"
        keys, h = KeyScheme("m", WSPEC.fingerprint, 0, "v1"), hashes(4, seed=13)
        assert path.run(t.Save(block_hashes=h, device_block_ids=[0, 1, 2, 3]), keys).blocks
        want, before = block(cache, 0), [block(cache, 20 + i) for i in range(4)]
        read = store._files.read
        stalls = [0.3]

        def stalled_read(*args):  # the disk: the first read returns after 0.3 s
            if stalls:
                time.sleep(stalls.pop())
            return read(*args)

        store._files.read = stalled_read
        load = t.Load(block_hashes=h, device_block_ids=[20, 21, 22, 23], timeout_ms=100)
        with pytest.raises(DeadlinePassed, match="before reading object 1 into its targets"):
            path.run(load, keys, time.monotonic() + 0.1)
        assert same(block(cache, 20), want)  # the read in flight: its own verified bytes
        assert all(same(block(cache, 21 + i), before[1 + i]) for i in range(3))
        path.close()


def test_tasks_cancelled_past_their_cutoff_in_a_burst_log_one_line_not_one_each(caplog) -> None:
    """After a long stall thousands of queued tasks pass their cutoff at once: the first is
    logged, the rest of the burst only counted, and the next line says how many went unlogged."""
    cancel_log = deadline.CancelLog(rank=3, interval_s=0.2)
    error = DeadlinePassed("cancelled before it started: ...")
    with caplog.at_level(logging.WARNING, logger="kvtier.worker.deadline"):
        for task_id in range(1, 1001):
            cancel_log(task_id, error)
        assert [r.getMessage() for r in caplog.records] == [
            "rank 3: task 1 cancelled before it started: ..."
        ]
        time.sleep(0.25)
        cancel_log(1001, error)
    assert caplog.records[-1].getMessage() == (
        "rank 3: task 1001 cancelled before it started: ... "
        "(999 more since the last such line, not logged)"
    )
    assert len(caplog.records) == 2


def test_datapath_refuses_bad_input_before_moving_anything(datapath) -> None:
    path, _, keys = datapath
    with pytest.raises(InvalidBlockIds, match="host block id 8 out of range 0..7"):
        path.run(t.SwapOut(device_block_ids=[1], host_block_ids=[8]), keys)  # staging is private
    with pytest.raises(InvalidBlockIds, match="host block id 3 appears twice"):
        path.run(t.LoadHost(block_hashes=hashes(2), host_block_ids=[3, 3]), keys)
    with pytest.raises(InvalidBlockHash, match="block hash 0 has 4 bytes"):
        path.run(t.Lookup(block_hashes=[b"abcd"]), keys)


# ---- ControlPlane -----------------------------------------------------------------------------


@pytest.fixture
def control_plane(tmp_path):
    config = WorkerConfig(
        spec=WSPEC,
        instance_id=f"cp{uuid.uuid4().hex[:8]}",
        device_cache_mode="create",
        storage={"backend": "memory"},
        num_host_blocks=4,
        staging_blocks=1,
    )
    resources = RankResources(config).open()
    gate = Gate()
    answers: list[tuple[str, Answer]] = []
    done = threading.Event()

    def reply(peer: bytes, task: t.Control, answer: Answer) -> None:
        answers.append((task.method, answer))
        done.set()

    plane = ControlPlane(
        resources,
        gate,
        submit=lambda item: None,
        reply=reply,
        cancel=lambda item, why: None,
        stats=lambda: {"ok": 1},
        rank=0,
    )

    def call(method: str, **args) -> Answer:
        done.clear()
        plane.receive(b"peer", t.Control(method=method, args=args))
        assert done.wait(10)
        return answers[-1][1]

    yield call, gate, resources
    plane.close()
    resources.close()


def test_control_plane_answers_in_every_state(control_plane) -> None:
    call, gate, resources = control_plane
    assert call("reboot").code is t.Code.BAD_REQUEST
    assert call("pause", bogus=1).code is t.Code.BAD_REQUEST
    assert call("pause").code is t.Code.OK and gate.state is WorkerState.PAUSED
    assert "already paused" in call("pause").message
    answer = call("update_weights", version="RL-STEP4")
    assert answer.code is t.Code.OK and resources.keys.version == "RL-STEP4"
    assert call("update_weights", version=5).code is t.Code.BAD_REQUEST
    assert call("update_weights", version="bad version").code is t.Code.BAD_REQUEST
    assert call("resume").code is t.Code.OK and gate.state is WorkerState.RUNNING
    assert call("sleep").code is t.Code.OK and gate.state is WorkerState.SLEEPING
    assert not resources.device_cache.attached
    assert call("resume").code is t.Code.CONFLICT
    assert call("wakeup").code is t.Code.OK and resources.device_cache.attached
    assert call("stats").data == {"ok": 1}


def test_a_weight_rollback_needs_to_be_asked_for(control_plane) -> None:
    """``update_weights`` to an older version, or to the empty one, was answered 200: a caller
    that rolled back by mistake (or with the secret of another) made stale KV hittable."""
    call, _, resources = control_plane
    assert call("update_weights", version="RL-STEP3").code is t.Code.OK
    assert call("update_weights", version="RL-STEP5").code is t.Code.OK
    for older in ("RL-STEP3", "RL-STEP4"):  # in force before; an earlier step never seen
        answer = call("update_weights", version=older)
        assert answer.code is t.Code.CONFLICT and "allow_rollback" in answer.message
        assert resources.keys.version == "RL-STEP5"
    assert call("update_weights", version="").code is t.Code.CONFLICT  # before any version
    assert call("update_weights", version="RL-STEP5").code is t.Code.OK  # idempotent
    assert call("update_weights", version="RL-STEP4", allow_rollback=1).code is t.Code.BAD_REQUEST
    answer = call("update_weights", version="RL-STEP3", allow_rollback=True)
    assert answer.code is t.Code.OK and "can be hit again" in answer.message
    assert resources.keys.version == "RL-STEP3"
    assert call("update_weights", version="RL-STEP6").code is t.Code.OK  # forward: no flag
    assert call("update_weights", version="", allow_rollback=True).code is t.Code.OK
    assert resources.keys.version == ""


# ---- a Worker and a Client in one process -----------------------------------------------------


@pytest.fixture(name="local_worker")
def local_worker_fixture():
    worker = local_worker("lw", num_host_blocks=8, staging_blocks=2)
    yield worker
    worker.close()


def test_worker_and_client_in_one_process(local_worker) -> None:
    cache = local_worker.resources.device_cache
    fill_random(cache, 4)
    want = block(cache, 5)
    with Client.connect([local_worker.config.endpoint], start_timeout_s=10) as client:
        assert client.swap_out([5], [0]).status is t.Status.OK
        assert client.swap_in([0], [9]).status is t.Status.OK
        assert same(block(cache, 9), want)
        h = hashes(2, 3)
        assert client.save(h, [5, 6]).blocks == [5, 6]
        assert client.load(h, [10, 11]).blocks == [10, 11] and same(block(cache, 10), want)
        assert client.control("pause").code == 200
        held = client.submit(t.SwapOut(device_block_ids=[1], host_block_ids=[1]))
        time.sleep(0.1)
        assert not held.done()
        assert client.control("resume").code == 200
        assert held.result(10).status is t.Status.OK
        stats = client.control("stats").per_rank[0].data
        assert stats["state"] == "running" and stats["tasks"]["save"]["tasks"] == 1


def test_saves_count_what_they_wrote_apart_from_what_was_already_stored(local_worker) -> None:
    """A fresh vLLM run over a full store reported 640 saved tokens with 0 bytes written."""
    fill_random(local_worker.resources.device_cache, 5)
    h = hashes(4, 7)
    with Client.connect([local_worker.config.endpoint], start_timeout_s=10) as client:
        first = client.save(h[:2], [1, 2])
        assert (first.blocks, first.count) == ([1, 2], 0) and first.bytes_moved > 0
        again = client.save(h, [1, 2, 3, 4])  # two stored already, two new
        assert (again.blocks, again.count) == ([1, 2, 3, 4], 2)
        assert again.bytes_moved == first.bytes_moved  # two blocks' bytes, as the first time
        repeat = client.save(h, [1, 2, 3, 4])
        assert (repeat.count, repeat.bytes_moved) == (4, 0)
        assert client.save_host(h[:1], [0]).count == 1  # host saves count the same way
        saves = client.control("stats").per_rank[0].data["tasks"]["save"]
        assert (saves["blocks_written"], saves["blocks_skipped"]) == (4, 6)


def test_a_peer_without_hello_gets_errors_and_keeps_nothing_alive(local_worker) -> None:
    peer = LocalClient([local_worker.config.endpoint])
    peer.open()
    peer.send(0, t.encode(t.SwapOut(task_id=5, device_block_ids=[1], host_block_ids=[1])))
    peer.send(0, msgspec.msgpack.encode({"type": "lookup", "task_id": 6, "block_hashes": 3}))
    answers = {}
    deadline = time.monotonic() + 10
    while len(answers) < 2 and time.monotonic() < deadline:
        for _, payload in peer.receive(0.1):
            for message in t.decode_frame(payload):  # answered in one turn: maybe a bundle
                answers[message.task_id] = message
    assert answers[5].status is t.Status.ERROR and "say hello first" in answers[5].message
    assert answers[6].status is t.Status.ERROR and "malformed task" in answers[6].message
    stats = local_worker.stats()
    assert stats["errors"]["unauthenticated"] == 1 and "swap_out" not in stats["tasks"]
    peer.close()


def test_the_gate_bounds_what_it_queues() -> None:
    gate, ran = Gate(max_pending=3), []
    gate.set_state(WorkerState.PAUSED)
    assert [gate.admit(i, ran.append) for i in range(4)] == [None, None, None, Refusal.FULL]
    assert gate.resume(ran.append) == 3 and ran == [0, 1, 2]
    assert gate.admit(9, ran.append) is Refusal.FULL  # three still running
    gate.done(0, 1, 2)
    assert gate.admit(9, ran.append) is None


def test_the_gate_bounds_each_clients_queued_ids() -> None:
    """100,000 queued tasks of 2^20 ids each used to be accepted (4.1 GiB RSS): the ids one
    client has admitted and not finished are bounded; other clients are unaffected."""
    gate, ran = Gate(weigh=lambda item: item, max_ids_per_owner=100), []
    gate.set_state(WorkerState.PAUSED)
    assert gate.admit(("a", 60), ran.append) is None
    assert gate.admit(("a", 41), ran.append) is Refusal.OWNER_FULL
    assert gate.admit(("b", 100), ran.append) is None  # another client has its own budget
    assert gate.queued_ids("a") == 60
    assert gate.take_held() == [("a", 60), ("b", 100)]  # answered by the caller: released
    assert gate.queued_ids("a") == 0
    gate.set_state(WorkerState.RUNNING)
    assert gate.admit(("a", 100), ran.append) is None
    assert gate.admit(("a", 1), ran.append) is Refusal.OWNER_FULL
    gate.done(("a", 100))
    assert gate.admit(("a", 1), ran.append) is None


def test_oversized_lists_are_refused_at_decode() -> None:
    big = msgspec.msgpack.encode(
        {
            "type": "swap_out",
            "task_id": 4,
            "device_block_ids": list(range(t.MAX_IDS_PER_TASK + 1)),
            "host_block_ids": [],
        }
    )
    with pytest.raises(msgspec.ValidationError, match=f"length <= {t.MAX_IDS_PER_TASK}"):
        t.decode(big)
    assert t.peek_task_id(big) == 4  # answered with an error, not dropped
    # A map key that is not text (an array) does not hide the task id either.
    odd_key = (
        b"\x85"
        + msgspec.msgpack.encode(
            {"type": "swap_out", "task_id": 6, "protocol_version": 0, "items": [0, 0]}
        )[1:]
    )
    odd_key += b"\x92\x00\x00" + msgspec.msgpack.encode("x")  # the fifth entry: [0, 0] -> "x"
    with pytest.raises(msgspec.ValidationError):
        t.decode(odd_key)
    assert t.peek_task_id(odd_key) == 6
    with pytest.raises(msgspec.ValidationError, match="length <= 64"):
        t.decode(t.encode(t.Lookup(block_hashes=[b"x" * 65])))
    for timeout_ms in (-1, t.MAX_TIMEOUT_MS + 1):  # a deadline is bounded like the rest
        bad = msgspec.msgpack.encode(
            {"type": "lookup", "task_id": 5, "block_hashes": [], "timeout_ms": timeout_ms}
        )
        with pytest.raises(msgspec.ValidationError, match="timeout_ms"):
            t.decode(bad)
    deep = b"\x83\xa4type\xa7control\xa7task_id\x05\xa1z" + b"\x91" * 50_000 + b"\x01"
    with pytest.raises(msgspec.DecodeError, match="nested too deeply"):
        t.decode(deep)


def test_the_client_survives_any_single_bad_message_from_a_worker() -> None:
    """1 KiB nested 1,000 deep used to kill the client's I/O thread (RecursionError), after
    which no timeout fired and the engine waited forever."""
    from kvtier.transport.local import LocalServer

    server = LocalServer(f"local://{uuid.uuid4().hex}")
    server.open()
    try:
        client = Client([server.endpoint], task_timeout_s=30, worker_timeout_s=60)
        starter = threading.Thread(target=client.start, args=(10,))
        starter.start()
        peer, hello = server.receive(10)[0]
        assert isinstance(t.decode(hello), t.Hello)
        welcome = t.Welcome(
            protocol_version=t.PROTOCOL_VERSION, rank=0, world_size=1, accepted=True
        )
        server.send(peer, t.encode(welcome))
        starter.join(10)
        future = client.submit(t.Lookup(block_hashes=[bytes(32)]))
        deadline = time.monotonic() + 10
        task = None
        while task is None and time.monotonic() < deadline:
            for _, payload in server.receive(0.1):
                for message in t.decode_frame(payload):
                    if isinstance(message, t.Lookup):
                        task = message
        deep = b"\x82\xa4type\xa6result\xa7task_id" + b"\x91" * 1000 + b"\x01"
        server.send(peer, deep)
        server.send(peer, b"\xc1 garbage")
        server.send(
            peer, t.encode(t.Result(task_id=task.task_id, status=t.Status.OK, count=3, rank=0))
        )
        assert future.result(10).count == 3  # the I/O thread lived through both
        client.close()
    finally:
        server.close()


def test_refused_hellos_are_logged_once_per_peer_per_interval(caplog) -> None:
    """Every refused hello used to be logged (~9 GiB a day per attacking connection)."""
    import logging

    from kvtier.worker.peers import PeerTable

    caplog.set_level(logging.WARNING, logger="kvtier.worker.loop")
    table = PeerTable(rank=0, max_peers=8)
    for i in range(1000):
        accepted, why = table.hello(f"p{i}".encode(), t.Hello(protocol_version=99, client_id="a"))
        assert not accepted and "protocol version 99" in why
    table.hello(b"q", t.Hello(protocol_version=99, client_id="another"))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "'a'" in lines[0] and "'another'" in lines[1]
    assert table.refusals.total == 1001
    assert len(table) == 8  # peers remembered are bounded too
    assert table.hello(b"r", t.Hello(protocol_version=t.PROTOCOL_VERSION)) == (True, "")
    assert table.accepted(b"r") and not table.accepted(b"p0")


def test_status_observers_never_push_the_engine_out_of_the_peer_table() -> None:
    """Each `kvtier status` run is a new peer: thousands of them must not make the worker
    forget its engine (whose tasks would then be refused with "say hello first")."""
    from kvtier.worker.peers import PeerTable

    table = PeerTable(rank=0, max_peers=4)
    assert table.hello(b"engine", t.Hello(protocol_version=t.PROTOCOL_VERSION))[0]
    for i in range(100):
        table.hello(
            f"status{i}".encode(), t.Hello(protocol_version=t.PROTOCOL_VERSION, observer=True)
        )
        table.hello(f"old{i}".encode(), t.Hello(protocol_version=99))
    assert table.accepted(b"engine") and not table.observer(b"engine")
    assert len(table) == 4


def test_one_start_up_line_names_the_store_its_capacity_the_namespace_and_the_version(
    tmp_path, caplog
) -> None:
    caplog.set_level("INFO", logger="kvtier.worker.loop")
    store = {"backend": "file", "root": str(tmp_path / "kv"), "capacity_bytes": 3 << 30}
    worker = local_worker("log", storage=store, namespace="llama.sha256", version="RL-STEP7")
    worker.close()
    (line,) = [r.getMessage() for r in caplog.records if "serving" in r.getMessage()]
    assert f"storage file at {tmp_path / 'kv'} (capacity 3.0 GiB, 0 objects held)" in line
    assert "namespace llama.sha256, weight version 'RL-STEP7'" in line
