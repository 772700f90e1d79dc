"""MooncakeStore: Mooncake Store as the distributed tier (zero-copy from the registered pool).

Each object is the same 64-byte header + page-first block as on disk. The host pool is
registered once; every host block is preceded by a header slot in the pool, so [header | block]
is one contiguous buffer and puts and gets are single-buffer ``batch_put_from`` /
``batch_get_into`` calls: payload bytes never pass through Python.

Mooncake's return codes are translated in one place, ``_classify``. Eviction by the store is an
ordinary miss. An unreachable master is ``StorageUnavailable``: the port is probed with a timeout
before ``setup()`` (which otherwise blocks ~90 s), and RPC failures on every key of a batch
raise it too.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np
import torch

from kvtier.common import bindguard
from kvtier.errors import ObjectCorrupt, StorageError, StorageUnavailable
from kvtier.layout.spec import KVCacheSpec
from kvtier.storage.base import Read, ReadResult, StorageUsage
from kvtier.storage.format import HEADER_BYTES
from kvtier.storage.mooncake.config import (
    Bounded,
    MooncakeConfig,
    import_mooncake,
    probe,
    probe_setup,
)
from kvtier.storage.object_store import ObjectStore

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 0.5
# Batches are moved in chunks of about this size so that checksums overlap the transfers.
PIPELINE_CHUNK_BYTES = 128 << 20


class Fate(Enum):
    """What a Mooncake return code means for one key."""

    OK = "ok"
    MISSING = "missing"
    FAILED = "failed"
    UNREACHABLE = "unreachable"


# Mooncake error codes (mooncake-store types.h) and what each means for kvtier.
_CODES = {
    -200: ("no space", Fate.FAILED),
    -600: ("invalid parameters", Fate.FAILED),
    -704: ("object not found", Fate.MISSING),
    -705: ("object already exists", Fate.OK),  # immutable: the stored object stays
    -706: ("object has lease", Fate.FAILED),
    -707: ("lease expired", Fate.MISSING),
    -800: ("transfer failed", Fate.FAILED),
    -900: ("RPC to master failed", Fate.UNREACHABLE),
}


def _classify(rc: int | None, ok_value: int = 0) -> Fate:
    if rc is None:
        return Fate.FAILED  # unregistered buffer
    if rc == ok_value:
        return Fate.OK
    if rc >= 0:
        return Fate.FAILED  # e.g. a short read: the object is not the size we store
    return _CODES.get(rc, ("unknown error", Fate.FAILED))[1]


def describe(rc: int) -> str:
    return f"{rc} ({_CODES.get(rc, ('unknown error',))[0]})"


@dataclass
class _Registered:
    pool: Any  # HostPool
    objects: np.ndarray  # [num_blocks, stride]: header slot + block, as numpy
    blocks: range  # the registered blocks


class MooncakeStore(ObjectStore):
    kind = "mooncake"
    exposes_registered_memory = True
    persistent = True

    def __init__(
        self,
        spec: KVCacheSpec,
        config: MooncakeConfig | Mapping[str, Any] | None = None,
        *,
        mac_key: bytes | None = None,
    ):
        super().__init__(spec, mac_key)
        if not isinstance(config, MooncakeConfig):
            config = MooncakeConfig.from_dict(config or {})
        self.config = config
        MooncakeDistributedStore = import_mooncake()
        probe(config.master_address, config.connect_timeout_s)
        probe_setup(config)
        _warn_if_unguarded(config.local_hostname)
        self._store = MooncakeDistributedStore()
        self._queries = Bounded("kvtier-mooncake-query", config)
        self._transfers = Bounded("kvtier-mooncake", config)
        rc = self._store.setup(  # holds the interpreter lock; probe_setup saw it return
            config.local_hostname,
            config.metadata_server,
            config.global_segment_size,
            config.local_buffer_size,
            config.protocol,
            config.device_name,
            config.master_address,
        )
        if rc != 0:
            raise StorageUnavailable(f"mooncake setup against {config.master_address} failed: {rc}")
        self._regions: list[_Registered] = []
        self._lock = threading.Lock()
        self._stored_bytes = 0
        self._stored_objects = 0
        self._closed = False
        self._down = False

    # ---- registration -----------------------------------------------------------------------

    def register_host_pool(self, pool, blocks: range | None = None) -> None:
        """Register ``blocks`` of the pool (header slots included; None: all) once, for
        zero-copy I/O. Mooncake's peers can read registered memory: register only what must
        move (a worker registers its staging, never the engine's host blocks)."""
        blocks = range(pool.num_blocks) if blocks is None else blocks
        if not blocks or blocks.step != 1 or blocks.start < 0 or blocks.stop > pool.num_blocks:
            raise StorageError(f"cannot register blocks {blocks} of a {pool.num_blocks}-block pool")
        with self._lock:
            if any(r.pool is pool for r in self._regions):
                return
            start = pool.base_address + blocks.start * pool.stride_bytes
            rc = self._store.register_buffer(start, len(blocks) * pool.stride_bytes)
            if rc != 0:
                raise StorageError(f"mooncake register_buffer failed: {describe(rc)}")
            self._regions.append(_Registered(pool, pool.objects.numpy(), blocks))

    def unregister_host_pool(self, pool) -> None:
        with self._lock:
            for region in [r for r in self._regions if r.pool is pool]:
                start = pool.base_address + region.blocks.start * pool.stride_bytes
                self._store.unregister_buffer(start)
                self._regions.remove(region)

    def _slots(self, host_blocks: Sequence[torch.Tensor]) -> list[tuple[np.ndarray, int]]:
        """(header slot, object address) of each block: [header | block] is one object."""
        out = []
        region = self._regions[0] if self._regions else None
        for i, block in enumerate(host_blocks):
            ptr = block.data_ptr()
            index = region.pool.block_index(ptr) if region is not None else None
            if region is None or index is None or index not in region.blocks:
                region = next((r for r in self._regions if _holds(r, ptr)), None)
                if region is None:
                    raise StorageError(
                        f"host block {i} is not a registered block of a HostPool: "
                        "call register_host_pool(pool, blocks) first"
                    )
                index = region.pool.block_index(ptr)
            assert region is not None and index is not None
            out.append((region.objects[index, :HEADER_BYTES], ptr - HEADER_BYTES))
        return out

    # ---- contract ---------------------------------------------------------------------------

    def exists_prefix(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        self._guard()
        codes = self._queries.call("exists", self._store.batch_is_exist, list(keys))
        self._check_reachable([_classify(c, 1) for c in codes], codes, "exists")
        for n, c in enumerate(codes):
            if c != 1:
                return n
        return len(keys)

    def put_from(self, keys, host_blocks, checksums=None, originals=None) -> list[bool]:
        self._check_batch(keys, host_blocks, checksums)
        if originals is not None:
            self._check_scattered(keys, originals)
        if not keys:
            return []
        slots = self._slots(host_blocks)
        self._guard()

        def prepare(chunk: range) -> None:
            for i in chunk:  # checksum and MAC over bytes no peer can write, where given
                payload = [host_blocks[i].numpy()] if originals is None else originals[i]
                known = checksums[i] if checksums is not None else None
                header = self.format.header(keys[i], payload, known)
                slots[i][0].data.cast("B")[:] = header

        def transfer(chunk: range) -> list[int]:
            return self._store.batch_put_from(
                [keys[i] for i in chunk],
                [slots[i][1] for i in chunk],
                [self.object_bytes] * len(chunk),
            )

        # Checksums of chunk k+1 are computed while chunk k is on the wire (GIL released).
        hashing = checksums is None or any(c is None for c in checksums)
        chunks = self._chunks(len(keys), hashing)
        prepare(chunks[0])
        codes: list[int] = []
        for k, chunk in enumerate(chunks):
            pending = self._transfers.submit("put", transfer, chunk)
            if k + 1 < len(chunks):
                prepare(chunks[k + 1])
            codes += self._transfers.wait("put", pending)
        outcomes = [_classify(c) for c in codes]
        self._check_reachable(outcomes, codes, "put")
        results = [o is Fate.OK for o in outcomes]
        failed = [describe(c) for c, ok in zip(codes, results) if not ok]
        if failed:
            log.debug("mooncake put: %d of %d failed (%s)", len(failed), len(keys), failed[0])
        with self._lock:
            self._stored_objects += sum(results)
            self._stored_bytes += sum(results) * self.object_bytes
        return self._count_puts(results)

    def _read(self, request: Read, result: ReadResult) -> None:
        keys, host_blocks = request.keys, request.host_blocks
        checksums_out, headers_out = result.checksums, result.headers
        if not keys:
            return
        slots = self._slots(host_blocks)
        self._guard()

        def transfer(chunk: range) -> list[int]:
            return self._store.batch_get_into(
                [keys[i] for i in chunk],
                [slots[i][1] for i in chunk],
                [self.object_bytes] * len(chunk),
            )

        # Chunk k+1 is fetched while chunk k is verified.
        chunks = self._chunks(len(keys), checksums_out is None)
        pending = self._transfers.submit("get", transfer, chunks[0])
        results: list[bool] = []
        codes: list[int] = []
        for k, chunk in enumerate(chunks):
            chunk_codes = self._transfers.wait("get", pending)
            if k + 1 < len(chunks):
                pending = self._transfers.submit("get", transfer, chunks[k + 1])
            codes += chunk_codes
            if k == 0:
                self._check_reachable(
                    [_classify(c, self.object_bytes) for c in chunk_codes], chunk_codes, "get"
                )
            for i, code in zip(chunk, chunk_codes):
                results.append(
                    self._verify(
                        i, keys[i], host_blocks[i], slots[i][0], code, checksums_out, headers_out
                    )
                )
        result.found[:] = results

    def _verify(self, index, key, block, header, code, checksums_out, headers_out) -> bool:
        outcome = _classify(code, self.object_bytes)
        if outcome is not Fate.OK:
            if code is not None and code >= 0:  # present but not the size we store: corrupt
                self._corrupt(key, ObjectCorrupt(f"object is {code} bytes"))
                self.delete([key])
            return False
        try:
            self.format.check_or_defer(
                header, block.numpy(), key, checksums_out, index, headers_out=headers_out
            )
        except ObjectCorrupt as e:
            self._corrupt(key, e)
            self.delete([key])
            return False
        return True

    def _chunks(self, n: int, hashing: bool) -> list[range]:
        """Pipeline chunks when payloads are hashed here; one batch (fastest) otherwise."""
        if not hashing:
            return [range(n)]
        per_chunk = max(1, PIPELINE_CHUNK_BYTES // self.object_bytes)
        return [range(i, min(n, i + per_chunk)) for i in range(0, n, per_chunk)]

    def delete(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        self._guard()
        codes = self._queries.call("remove", self._store.batch_remove, list(keys), True)
        removed = sum(1 for c in codes if c == 0)
        with self._lock:
            self._stored_objects = max(0, self._stored_objects - removed)
            self._stored_bytes = max(0, self._stored_bytes - removed * self.object_bytes)
        return removed

    def usage(self) -> StorageUsage:
        """Objects this client stored (the master evicts silently, so an upper bound)."""
        with self._lock:
            return StorageUsage(
                self._stored_bytes, self._stored_objects, self.config.global_segment_size
            )

    def read_object(self, key: str) -> bytes | None:
        data = self._store.get(key)
        return bytes(data) if data else None

    def write_object(self, key: str, data: bytes) -> None:
        self._store.remove(key, True)
        rc = self._store.put(key, data)
        if rc != 0:
            raise StorageError(f"mooncake put of {key} failed: {describe(rc)}")

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for region in self._regions:
                self._store.unregister_buffer(region.pool.base_address)
            self._regions.clear()
        stuck = self._transfers.shutdown() | self._queries.shutdown()
        if not stuck:  # a call stuck in Mooncake would never let close() return
            self._store.close()

    def _check_reachable(self, outcomes: list[Fate], codes: list[int], what: str) -> None:
        """Every key failing with an RPC error means the master is gone: StorageUnavailable."""
        if outcomes and all(o is Fate.UNREACHABLE for o in outcomes):
            self._down = True
            log.warning(
                "mooncake master %s is unreachable (%s: %s)",
                self.config.master_address,
                what,
                describe(codes[0]),
            )
            raise StorageUnavailable(
                f"mooncake master {self.config.master_address} is unreachable "
                f"({what}: {describe(codes[0])})"
            )

    def _guard(self) -> None:
        """While the master is known to be down, fail fast with a port probe.

        Mooncake's own calls retry for ~4 s each when the master is gone; a TCP probe answers in
        well under a second, and lets the client's own reconnection take over once it is back.
        A master that accepts connections but does not answer leaves a call stuck: until it
        returns, every call fails at once (``_Bounded``).
        """
        self._queries.check("call")
        self._transfers.check("call")
        if self._down:
            probe(self.config.master_address, PROBE_TIMEOUT_S)
            self._down = False
            log.info("mooncake master %s is reachable again", self.config.master_address)


def _warn_if_unguarded(host: str) -> None:

    if bindguard.library() is not None and not bindguard.active(host):
        log.warning(
            "this process was started without kvtier's bind guard: Mooncake's transfer engine "
            "will listen on every interface, not only %s (run workers with `kvtier serve` or "
            "Client.launch, or start this process with the environment of "
            "kvtier.storage.mooncake.config.process_environment)",
            host,
        )


def _holds(region: _Registered, address: int) -> bool:
    return region.pool.block_index(address) in region.blocks
