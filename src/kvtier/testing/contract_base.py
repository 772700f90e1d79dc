"""The storage contract's parts every section shares: the spec, the deterministic bytes, keys,
the MAC switch, a forger's reseal, the second process, and the fixtures (``ContractBase``)."""

from __future__ import annotations

import contextlib
import hashlib
import struct
import uuid
from typing import Any

import numpy as np
import pytest
import torch
import xxhash

from kvtier.layout.keys import KeyScheme, block_hashes
from kvtier.layout.spec import CacheDType, KVCacheSpec
from kvtier.memory.host import HostPool
from kvtier.storage import HEADER_BYTES, ObjectFormat, make_backend
from kvtier.storage.base import StorageBackend

# fp8 with scales: every backend must carry every part.
CONTRACT_SPEC = KVCacheSpec(
    num_layers=2,
    num_blocks=8,
    num_kv_heads=2,
    block_size=16,
    head_dim=64,
    dtype=CacheDType.BLOCK_WISE_FP8,
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
    stores = [store] + ([store.wrapped] if store.wrapped is not store else [])
    saved = [s.format for s in stores]
    for s in stores:
        s.format = ObjectFormat(s.spec.fingerprint, key)
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


def store_round_trip(
    spec_dict: dict, config: dict, put_keys: list[str], get_keys: list[str], results: Any, done: Any
) -> None:
    """In a second process: store ``put_keys``, read back ``get_keys`` (checked bytes), report,
    and stay alive until ``done`` (Mooncake keeps objects in the segments of live clients)."""

    spec = KVCacheSpec.from_dict(spec_dict)
    with HostPool(spec, len(put_keys) + len(get_keys)) as pool, make_backend(spec, config) as store:
        store.register_host_pool(pool)
        blocks = [pool.block(i) for i in range(len(put_keys))]
        for key, block in zip(put_keys, blocks):
            block.copy_(expected_block(key, block.numel()))
        put_ok = store.put_from(put_keys, blocks)
        targets = [pool.block(len(put_keys) + i) for i in range(len(get_keys))]
        got = store.get_into(get_keys, targets)
        seen = [
            ok and bool(torch.equal(b, expected_block(k, b.numel())))
            for k, b, ok in zip(get_keys, targets, got)
        ]
        results.put((put_ok, seen))
        done.wait(120)


class ContractBase:
    """What every part of the contract needs: the fixtures, and put/get of checked bytes."""

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
