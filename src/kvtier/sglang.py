"""kvtier's storage as SGLang's HiCache L3 backend (``--hicache-storage-backend dynamic``).

SGLang loads it by configuration only::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.sglang", "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1, "storage": {"backend": "file", "root": "/data/kv"},
        "model_dir": "/models/llama"}'

``interface_v1: 1`` selects the zero-copy calls: pages move between SGLang's host pool (the
buffers ``get_page_buffer_meta`` names: K and V of a page, or one MLA buffer) and kvtier's
store without a staging copy where the store reads and writes pieces (file, memory), through
one block where it does not (Mooncake, S3). Keys: SGLang's page hash (already seeded with its
``extra_key`` and ``cache_salt``) as kvtier's block hash, with the model (``namespace``,
default SGLang's model name), the weight version (``weight_version``, or ``model_dir``'s
``version.yaml``, read again when it changes), a layout that names the page's bytes and the
parallel geometry, and the rank. MLA ranks hold the same KV: they share keys, and only the
storage writer (``HiCacheStorageConfig.is_storage_writer``) writes. Every load is checked
(checksum or MAC, layout, key): a bad object is a miss. ``clear()`` removes what this backend
stored under the current weight version, never another model's, rank's or version's objects.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from kvtier.errors import ConfigError
from kvtier.hosted.settings import HostedSettings
from kvtier.hosted.shelf import Shelf, bytes_spec, fold_hash

log = logging.getLogger(__name__)

FIELD = "hicache_storage_backend_extra_config"
# extra_config keys that are SGLang's own (its dynamic loader, its controller), not kvtier's.
SGLANG_KEYS = (
    "backend_name",
    "module_path",
    "class_name",
    "interface_v1",
    "enable_metadata_cache",
    "metadata_ttl",
    "tp_lcm_size",
)


@functools.lru_cache(maxsize=64)
def _bytes_type(nbytes: int) -> type[ctypes.Array]:
    # One ctypes array type per size, kept: each ``c_ubyte * n`` is a new heap type otherwise.
    return ctypes.c_ubyte * nbytes


def _buffer(address: int, nbytes: int) -> memoryview:
    """A writable view of ``nbytes`` of the host pool at ``address`` (no copy)."""
    return memoryview(_bytes_type(nbytes).from_address(address)).cast("B")


def page_hash(key: str) -> bytes:
    """kvtier's block hash for an SGLang page key (the hex of its SHA-256 page hash)."""
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raw = b""
    return fold_hash(raw) if raw else hashlib.sha256(key.encode()).digest()


class KvtierHiCacheStorage(HiCacheStorage):
    """A HiCache storage backend over kvtier's storage (module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        settings = HostedSettings.parse(extra, FIELD, ignore=SGLANG_KEYS)
        if not settings.namespace:
            if not storage_config.model_name:
                raise ConfigError(f"{FIELD}.namespace", "SGLang named no model: set namespace")
            settings = HostedSettings(
                settings.storage,
                storage_config.model_name,
                settings.weight_version,
                settings.model_dir,
            )
        self.config = storage_config
        self._settings = settings
        self._shelf: Shelf | None = None
        self._stored: set[str] = set()
        self._lock = threading.Lock()  # _stored and the metrics below
        self._prefetch_pages: list[int] = []
        self._backup_pages: list[int] = []
        self._prefetch_bandwidth: list[float] = []
        self._backup_bandwidth: list[float] = []

    # ---- the host pool and the layout --------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self._shelf is not None:
            self._shelf.close()
        page = torch.arange(mem_pool_host.page_size, dtype=torch.int64)
        _, sizes = mem_pool_host.get_page_buffer_meta(page)
        sizes = list(sizes) if not isinstance(sizes, int) else [sizes]
        self._page_bytes = sum(sizes)
        self._shelf = Shelf(self._settings, bytes_spec(self._page_bytes, self._layout(sizes)))
        self._shelf.open()
        # What kvtier's tiers evict leaves the set ``clear`` removes (it would only grow).
        self._shelf.backend.watch_removals(self._forget)
        log.info(
            "kvtier HiCache backend: %d-byte pages (%d buffers each), rank %d, %s",
            self._page_bytes,
            len(sizes),
            self._rank(),
            self._settings.storage,
        )

    def _forget(self, storage_keys: list[str]) -> None:
        with self._lock:
            self._stored.difference_update(storage_keys)

    def _layout(self, sizes: list[int]) -> str:
        pool, c = self.mem_pool_host, self.config
        described = {
            "sizes": sizes,
            "layout": str(getattr(pool, "layout", "")),
            "dtype": str(getattr(pool, "dtype", "")),
            "page_size": pool.page_size,
            "mla": c.is_mla_model,
            # MLA ranks hold the same KV (one key for all); others hold their heads' share.
            "tp_size": 1 if c.is_mla_model else c.tp_size,
            "pp_size": c.pp_size,
            "cp_size": c.attn_cp_size,
            "dcp_size": c.dcp_size,
        }
        digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
        return f"sglang-{digest[:16]}"

    def _rank(self) -> int:
        c = self.config
        tp_rank = c.dcp_rank if c.is_mla_model else c.tp_rank
        return tp_rank + c.tp_size * (c.pp_rank + c.pp_size * c.attn_cp_rank)

    @property
    def shelf(self) -> Shelf:
        if self._shelf is None:
            raise RuntimeError("SGLang registers its host pool first (register_mem_pool_host)")
        return self._shelf

    def _keys(self, keys: Sequence[str]) -> list[str]:
        return self.shelf.keys([page_hash(k) for k in keys], self._rank())

    def _pages(self, host_indices: torch.Tensor, count: int) -> list[list[memoryview]]:
        addresses, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if isinstance(sizes, int):
            sizes = [sizes] * len(addresses)
        if count == 0 or len(addresses) % count:
            raise ValueError(f"{count} keys for {len(addresses)} host buffers")
        each = len(addresses) // count
        return [
            [_buffer(a, n) for a, n in zip(addresses[i * each : (i + 1) * each],
                                            sizes[i * each : (i + 1) * each], strict=True)]
            for i in range(count)
        ]  # fmt: skip

    # ---- zero-copy pages (interface_v1) ------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        if not keys:
            return 0
        try:
            return self.shelf.lookup_prefix(self._keys(keys))
        except Exception as e:  # a store that cannot answer: nothing found
            log.warning("kvtier HiCache lookup of %d pages failed: %s", len(keys), e)
            return 0

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        if not keys:
            return []
        start = time.monotonic()
        try:
            found = self.shelf.get_pieces(self._keys(keys), self._pages(host_indices, len(keys)))
        except Exception as e:  # answered as misses; the cause is logged
            log.warning("kvtier HiCache get of %d pages failed: %s", len(keys), e)
            return [False] * len(keys)
        self._measured(self._prefetch_pages, self._prefetch_bandwidth, sum(found), start)
        return found

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        if not keys:
            return []
        if not self.config.is_storage_writer:
            return [True] * len(keys)  # an MLA replica: its writer stores these pages
        start = time.monotonic()
        try:
            storage_keys = self._keys(keys)
            stored = self.shelf.put_pieces(storage_keys, self._pages(host_indices, len(keys)))
        except Exception as e:  # answered as failures; the cause is logged
            log.warning("kvtier HiCache set of %d pages failed: %s", len(keys), e)
            return [False] * len(keys)
        with self._lock:
            self._stored.update(k for k, ok in zip(storage_keys, stored, strict=True) if ok)
        self._measured(self._backup_pages, self._backup_bandwidth, sum(stored), start)
        return stored

    def _measured(self, pages: list, bandwidth: list, count: int, start: float) -> None:
        elapsed = time.monotonic() - start
        with self._lock:
            pages.append(count)
            if elapsed > 0 and count:
                bandwidth.append(count * self._page_bytes / elapsed / 1e9)  # GB/s

    # ---- the rest of the interface -----------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self._copy_api()

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None):
        return self._copy_api()

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes=None):
        return self._copy_api()

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:  # fmt: skip
        return self._copy_api()

    def _copy_api(self) -> Any:
        raise NotImplementedError(
            "kvtier's HiCache backend moves pages zero-copy only: add "
            '"interface_v1": 1 to --hicache-storage-backend-extra-config'
        )

    def clear(self) -> None:
        with self._lock:
            keys, self._stored = list(self._stored), set()
        if keys:
            removed = self.shelf.delete(keys)
            log.info("kvtier HiCache clear: %d of %d pages removed", removed, len(keys))

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` of the calls since the last (pages and GB/s of each
        prefetch and backup), with kvtier's counters as ``.kvtier``; None where SGLang's
        metrics module cannot load (it then logs empty metrics)."""
        with self._lock:
            measured = (
                self._prefetch_pages,
                self._backup_pages,
                self._prefetch_bandwidth,
                self._backup_bandwidth,
            )
            self._prefetch_pages, self._backup_pages = [], []
            self._prefetch_bandwidth, self._backup_bandwidth = [], []
        try:
            # local: loaded with SGLang's scheduler already; on a bare install it needs more
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError as e:
            log.debug("SGLang's StorageMetrics not loadable: %s", e)
            return None
        metrics = StorageMetrics(*measured)
        metrics.kvtier = self.stats()
        return metrics

    def stats(self) -> dict[str, Any]:
        """kvtier's counters for this backend (hits, misses, corrupt, evictions, bytes)."""
        return self._shelf.stats() if self._shelf is not None else {}

    def close(self) -> None:
        if self._shelf is not None:
            self._shelf.close()
            self._shelf = None
