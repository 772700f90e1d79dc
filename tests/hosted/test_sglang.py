"""kvtier as SGLang's HiCache L3 backend, created by SGLang's own ``StorageBackendFactory``
(``dynamic``, by module path) from a ``HiCacheStorageConfig``, and called as its cache
controller calls it (``register_mem_pool_host``, ``batch_exists``, zero-copy ``batch_set_v1`` /
``batch_get_v1``): pages round-trip byte-exact; a stale weight version, a corrupt object and
another TP rank are misses; MLA replicas share keys with one writer; the bound holds.

Where this stops: SGLang 0.5.23's host pool classes (``pool_host``) import its model configs,
which import torchvision (a CUDA build on PyPI that breaks transformers beside the CPU torch),
and its HiCache refuses the CPU platform. So the host pool here is real memory laid out as its
``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` lay it out, answering
``get_page_buffer_meta`` with 0.5.23's formulas (``kvtier.testing.engines``); no SGLang server
runs (docs/sglang.md)."""

from __future__ import annotations

import hashlib
import os

import pytest

from conftest import require_peer

require_peer("sglang")

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvtier.hosted import shelf as shelf_module  # noqa: E402
from kvtier.sglang import KvtierHiCacheStorage  # noqa: E402
from kvtier.testing.engines import SGLangHostPool as HostPool  # noqa: E402


def page_keys(n: int, salt: str = "") -> list[str]:
    """SGLang's page keys: chained SHA-256 hex digests (seeded with its extra key and salt)."""
    keys, parent = [], salt.encode()
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        keys.append(parent.hex())
    return keys


def config(extra: dict, tp_rank: int = 0, tp_size: int = 1, mla: bool = False):
    base = {"backend_name": "kvtier", "module_path": "kvtier.sglang",
            "class_name": "KvtierHiCacheStorage", "interface_v1": 1}  # fmt: skip
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=True,
        is_page_first_layout=True,
        model_name="org/model",
        extra_config={**base, **extra},
    )


def backend(pool: HostPool, extra: dict, **kw) -> KvtierHiCacheStorage:
    """As SGLang's cache controller attaches it: its factory, then the host pool."""
    made = StorageBackendFactory.create_backend("dynamic", config(extra, **kw), pool)
    assert isinstance(made, KvtierHiCacheStorage)
    made.register_mem_pool_host(pool)
    return made


@pytest.mark.parametrize(
    "layout,mla,storage",
    [
        ("page_first", False, "file"),
        ("layer_first", False, "file"),
        ("page_first", True, "file"),
        ("page_first", False, "memory"),  # no scattered I/O: pages through one block
    ],
)
def test_sglangs_factory_creates_it_and_pages_round_trip_byte_exact(tmp_path, layout, mla, storage):
    pool = HostPool(layout, mla)
    store = {"backend": storage}
    if storage == "file":
        store["root"] = str(tmp_path)
    made = backend(pool, {"storage": store})
    try:
        pool.fill(seed=1)
        keys = page_keys(6)
        written = [pool.page_bytes(p) for p in range(6)]
        assert made.batch_set_v1(keys, pool.indices(list(range(6)))) == [True] * 6
        assert made.batch_exists(keys) == 6
        pool.kv_buffer.zero_()
        assert made.batch_get_v1(keys, pool.indices(list(range(8, 14)))) == [True] * 6
        assert [pool.page_bytes(p) for p in range(8, 14)] == written
        assert made.batch_exists(page_keys(3, salt="other")) == 0
        assert made.stats()["hits"] == 6
    finally:
        made.close()


def test_batch_exists_is_the_stored_prefix(tmp_path):
    pool = HostPool()
    made = backend(pool, {"storage": {"backend": "file", "root": str(tmp_path)}})
    try:
        keys = page_keys(5)
        made.batch_set_v1(keys[:2] + keys[3:], pool.indices([0, 1, 3, 4]))
        assert made.batch_exists(keys) == 2
    finally:
        made.close()


def test_a_stale_weight_version_gets_no_hit(tmp_path, monkeypatch):
    monkeypatch.setattr(shelf_module, "VERSION_CHECK_S", 0.0)
    model = tmp_path / "model"
    model.mkdir()
    (model / "version.yaml").write_text("version: RL-STEP7-20261207-x\n")
    pool = HostPool()
    made = backend(pool, {"storage": {"backend": "file", "root": str(tmp_path / "s")},
                          "model_dir": str(model)})  # fmt: skip
    try:
        keys = page_keys(3)
        made.batch_set_v1(keys, pool.indices([0, 1, 2]))
        assert made.batch_exists(keys) == 3
        (model / "version.yaml").write_text("version: RL-STEP8-20261207-y\n")
        os.utime(model / "version.yaml", ns=(1, 1))
        assert made.batch_exists(keys) == 0
        assert made.batch_get_v1(keys, pool.indices([4, 5, 6]))[0] is False
    finally:
        made.close()


def test_a_corrupt_page_is_a_miss_never_bytes(tmp_path):
    pool = HostPool()
    made = backend(pool, {"storage": {"backend": "file", "root": str(tmp_path)}})
    try:
        pool.fill(seed=2)
        keys = page_keys(3)
        first = pool.page_bytes(0)
        made.batch_set_v1(keys, pool.indices([0, 1, 2]))
        shelf = made.shelf
        bad = made._keys(keys[1:2])[0]
        raw = bytearray(shelf.backend.read_object(bad))
        raw[-3] ^= 0x10
        shelf.backend.write_object(bad, bytes(raw))
        pool.fill(seed=3)
        found = made.batch_get_v1(keys, pool.indices([8, 9, 10]))
        assert found[:2] == [True, False]
        assert pool.page_bytes(8) == first
        assert pool.page_bytes(9) == bytes(len(first))  # a failed page is zeroed
        assert shelf.backend.stats.corrupt == 1
    finally:
        made.close()


def test_tp_ranks_never_share_a_key_and_mla_replicas_share_one_writer(tmp_path):
    storage = {"storage": {"backend": "file", "root": str(tmp_path)}}
    pools = [HostPool(), HostPool()]
    ranks = [backend(p, storage, tp_rank=r, tp_size=2) for r, p in enumerate(pools)]
    mla_pools = [HostPool(mla=True), HostPool(mla=True)]
    mla = [backend(p, storage, tp_rank=r, tp_size=2, mla=True) for r, p in enumerate(mla_pools)]
    try:
        keys = page_keys(2)
        pools[0].fill(seed=4)
        ranks[0].batch_set_v1(keys, pools[0].indices([0, 1]))
        assert ranks[1].batch_exists(keys) == 0  # rank 1 holds other heads
        assert ranks[0]._keys(keys) != ranks[1]._keys(keys)

        mla_pools[1].fill(seed=5)
        assert mla[1].batch_set_v1(keys, mla_pools[1].indices([0, 1])) == [True, True]
        assert mla[0].batch_exists(keys) == 0  # rank 1 is not the writer: nothing stored
        mla_pools[0].fill(seed=6)
        expected = [mla_pools[0].page_bytes(p) for p in (0, 1)]
        mla[0].batch_set_v1(keys, mla_pools[0].indices([0, 1]))
        assert mla[1].batch_get_v1(keys, mla_pools[1].indices([4, 5])) == [True, True]
        assert [mla_pools[1].page_bytes(p) for p in (4, 5)] == expected
    finally:
        for made in ranks + mla:
            made.close()


def test_the_bound_holds_and_clear_removes_only_its_own(tmp_path):
    pool = HostPool()
    page = sum(pool.get_page_buffer_meta(pool.indices([0]))[1])
    capacity = 6 * (page + 512)  # six objects (a header each)
    made = backend(pool, {"storage": {"backend": "file", "root": str(tmp_path),
                                      "capacity_bytes": capacity}})  # fmt: skip
    other = backend(HostPool(), {"storage": {"backend": "file", "root": str(tmp_path)},
                                 "namespace": "another-model"})  # fmt: skip
    try:
        for batch in range(4):
            keys = page_keys(4, salt=str(batch))
            assert made.batch_set_v1(keys, pool.indices([0, 1, 2, 3])) == [True] * 4
        stats = made.stats()
        assert stats["used_bytes"] <= capacity and stats["evictions"] > 0
        theirs = page_keys(2, salt="theirs")
        other.batch_set_v1(theirs, other.mem_pool_host.indices([0, 1]))
        made.clear()
        assert made.batch_exists(page_keys(4, salt="3")) == 0
        assert other.batch_exists(theirs) == 2
    finally:
        made.close()
        other.close()


def test_bad_settings_name_the_field_and_the_copy_api_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="hicache_storage_backend_extra_config.colour"):
        StorageBackendFactory.create_backend("dynamic", config({"colour": 1}), HostPool())
    made = backend(HostPool(), {"storage": {"backend": "file", "root": str(tmp_path)}})
    try:
        with pytest.raises(NotImplementedError, match="interface_v1"):
            made.batch_get(["a"])
    finally:
        made.close()


def test_a_large_batch_round_trips_through_the_striped_writers(tmp_path):
    """Pages of 256 KiB, 12 at once: written by several threads (``Shelf.put_pieces``)."""
    pool = HostPool(layers=8, heads=8, head_dim=64, page_size=16, pages=24)
    made = backend(pool, {"storage": {"backend": "file", "root": str(tmp_path)}})
    try:
        pool.fill(seed=9)
        keys = page_keys(12)
        written = [pool.page_bytes(p) for p in range(12)]
        assert made.batch_set_v1(keys, pool.indices(list(range(12)))) == [True] * 12
        assert made.batch_exists(keys) == 12
        assert made.batch_get_v1(keys, pool.indices(list(range(12, 24)))) == [True] * 12
        assert [pool.page_bytes(p) for p in range(12, 24)] == written
    finally:
        made.close()
