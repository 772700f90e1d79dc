"""What kvtier holds, told to routers: a worker's save and load results name the blocks its store
evicted or a weight update retired (``kvtier.worker.removals``), and the connector turns every
rank's news into vLLM's own KV events (``kvtier.vllm.events``). The real engine and vLLM's publisher
are in ``tests/engine/test_vllm.py``."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from conftest import fill_random, require_vllm
from kvtier.engine.client import Client
from kvtier.layout.keys import KeyScheme
from kvtier.storage.file.store import FileStore
from kvtier.transport import tasks as t
from worker_helpers import WSPEC, hashes, local_worker

require_vllm()

from vllm.distributed.kv_events import BlockRemoved, BlockStored  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash  # noqa: E402

from kvtier.vllm.events import RankReport, TierEvents, publishing  # noqa: E402


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_results_name_the_blocks_the_store_evicted_then_all_after_a_weight_update(
    backend, tmp_path
) -> None:
    capacity = 3 * (WSPEC.block_bytes + 64 + 200)  # three objects (with header and key)
    storage = {"backend": backend, "capacity_bytes": capacity}
    if backend == "file":
        storage["root"] = str(tmp_path / "store")
    worker = local_worker("ev", num_host_blocks=4, staging_blocks=2, storage=storage)
    try:
        fill_random(worker.resources.device_cache, 2)
        first, second = hashes(3, 1), hashes(3, 2)
        with Client.connect([worker.config.endpoint], start_timeout_s=10) as client:
            saved = client.save(first, [0, 1, 2])
            assert saved.blocks == [0, 1, 2] and saved.removed == []
            evicting = client.save(second, [3, 4, 5])  # the store holds three: first is evicted
            assert evicting.status is t.Status.OK
            assert sorted(evicting.removed) == sorted(first)
            assert client.lookup(first) == 0
            assert client.control("update_weights", version="RL-STEP1").code == 200
            after = client.load(second, [6, 7, 8])  # the next storage answer tells it
            assert after.all_removed and after.blocks == []
            assert client.save(first, [0, 1, 2]).all_removed is False  # told once
    finally:
        worker.close()


def test_a_file_store_reports_only_keys_whose_trailer_names_their_object(tmp_path) -> None:
    """An evicted object whose key trailer was planted (another object's key) names nothing."""
    import torch

    from kvtier.memory.host import HostPool

    heard: list[list[str]] = []
    scheme = KeyScheme("ns", WSPEC.fingerprint, 0)
    keys = scheme.keys(hashes(4, 3))
    capacity = 2 * (WSPEC.block_bytes + 64 + 200)  # two objects (with header and key)
    with (
        FileStore(WSPEC, {"root": tmp_path, "capacity_bytes": capacity}) as store,
        HostPool(WSPEC, 1) as pool,
    ):
        store.watch_removals(heard.append)
        pool.block(0)[:] = torch.randint(0, 255, pool.block(0).shape, dtype=torch.uint8)
        for key in keys[:2]:  # oldest first
            assert store.put_from([key], [pool.block(0)]) == [True]
        planted = store._path(keys[0])
        data = planted.read_bytes()
        planted.write_bytes(data[: -len(keys[0])] + keys[1].encode())  # names keys[1]'s object
        assert store.put_from([keys[2]], [pool.block(0)]) == [True]  # evicts keys[0]'s object
        assert heard == []
        assert store.put_from([keys[3]], [pool.block(0)]) == [True]  # evicts keys[1]'s
        assert heard == [[keys[1]]]


def _hashes(*names: str) -> list[bytes]:
    return [name.encode().ljust(32, b".") for name in names]


def _published(hashes: list[bytes]) -> list:
    return [maybe_convert_block_hash(BlockHash(h)) for h in hashes]


def test_a_block_is_stored_once_every_rank_has_it_and_removed_once_any_rank_lost_it() -> None:
    a, b, c = _hashes("a", "b", "c")
    tier = TierEvents(world_size=2, block_size=16, backend="file")
    tier.add([RankReport(0, stored=[a, b, c])])
    assert tier.take() == []  # rank 1 has not stored them yet: a router must not send there
    tier.add([RankReport(1, stored=[a, b]), RankReport(1, stored=[a])])
    (stored,) = tier.take()
    assert isinstance(stored, BlockStored) and stored.block_hashes == _published([a, b])
    assert (stored.medium, stored.ownership, stored.block_size) == ("STORAGE", "kvtier:file", 16)
    assert stored.token_ids == []  # hashes only, never the prompt's tokens
    tier.add([RankReport(0, removed=[b, c]), RankReport(1, stored=[c])])
    (removed,) = tier.take()  # c was never on both ranks: only b is announced gone, and c stays
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == _published([b])
    tier.add([RankReport(0, stored=[b]), RankReport(1, stored=[b])])
    tier.add([RankReport(1, all_removed=True)])
    events = tier.take()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved]
    assert sorted(events[1].block_hashes) == sorted(_published([a, b]))
    tier.add([RankReport(0, removed=[a])])
    assert tier.take() == []  # nothing announced is left to remove


def test_events_go_only_to_a_publisher_bound_to_a_host_unless_asked(caplog) -> None:
    def config(endpoint: str, enabled: bool = True) -> SimpleNamespace:
        events = SimpleNamespace(enable_kv_cache_events=enabled, publisher="zmq", endpoint=endpoint)
        return SimpleNamespace(kv_events_config=events)

    assert publishing(config("tcp://127.0.0.1:5557"), "auto")
    assert not publishing(config("tcp://127.0.0.1:5557", enabled=False), "auto")
    assert not publishing(config("tcp://127.0.0.1:5557"), "off")
    with caplog.at_level(logging.WARNING):
        assert not publishing(config("tcp://*:5557"), "auto", warn=True)
    assert "binds every interface" in caplog.text and "any_interface" in caplog.text
    assert publishing(config("tcp://*:5557"), "any_interface")
    assert not publishing(SimpleNamespace(kv_events_config=None), "auto")


def test_a_loopback_port_for_kv_events_is_warned_about_and_ipc_is_not(caplog) -> None:
    """A local user who binds the port first receives vLLM's events (token ids included in its
    GPU-tier events); one who connects to the router's forges events. Round 5: said once, with
    the remedy (an ipc:// path in a 0700 directory)."""

    def config(endpoint: str) -> SimpleNamespace:
        events = SimpleNamespace(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
        return SimpleNamespace(kv_events_config=events)

    with caplog.at_level(logging.WARNING):
        assert publishing(config("tcp://127.0.0.1:5557"), "auto", warn=True)
    assert "any local user can bind first" in caplog.text and "ipc://" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert publishing(config("ipc:///run/user/0/kv-events"), "auto", warn=True)
        assert publishing(config("tcp://127.0.0.1:5557"), "auto")  # a worker side: no warning
    assert caplog.text == ""
