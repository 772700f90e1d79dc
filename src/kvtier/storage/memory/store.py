"""MemoryStore: the reference backend — a dict of encoded objects, optional LRU capacity."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.errors import ObjectCorrupt
from kvtier.layout.spec import KVCacheSpec
from kvtier.storage.base import Read, ReadResult, StorageUsage
from kvtier.storage.format import HEADER_BYTES
from kvtier.storage.object_store import ScatteredObjectStore


class MemoryStore(ScatteredObjectStore):
    """Objects in this process's memory. Stores the same bytes a file would hold, so the
    corruption and fingerprint checks run exactly as for the other backends."""

    kind = "memory"
    quick_lookups = True
    exposes_registered_memory = False
    persistent = False

    def __init__(
        self, spec: KVCacheSpec, capacity_bytes: int | None = None, *, mac_key: bytes | None = None
    ) -> None:
        super().__init__(spec, mac_key)
        self.capacity_bytes = capacity_bytes
        self._objects: OrderedDict[str, bytes] = OrderedDict()
        # Stored objects whose header is known sound: written by a put here, or checked once.
        # (An object is immutable; only ``write_object`` replaces one, and it is checked again.)
        self._sound: set[str] = set()
        # Objects a put of this store encoded (not ``write_object``): in this process's memory,
        # so their reads skip the MAC (``ObjectFormat.check``'s ``mac``; the checksum stays).
        self._authored: set[str] = set()
        self._used = 0
        self._lock = threading.Lock()
        self._spill: Callable[[list[tuple[str, bytes]]], None] | None = None

    def watch_spills(self, listener: Callable[[list[tuple[str, bytes]]], None]) -> None:
        """Hand ``listener`` each object this store evicts for capacity, bytes included, before
        they are dropped (a tier chain writes them down to a lower tier). Called on the thread
        whose put evicted, outside the store's lock; it may wait (that put waits with it)."""
        self._spill = listener

    def exists_prefix(self, keys: Sequence[str]) -> int:
        """Counts an object only if its header is sound (the payload is checked on reads)."""
        for n, key in enumerate(keys):
            if key not in self._sound and not self._header_ok(key):
                return n
        return len(keys)

    def _header_ok(self, key: str) -> bool:
        with self._lock:
            data = self._objects.get(key)
        if data is None:
            return False
        try:
            if len(data) != self.object_bytes:
                raise ObjectCorrupt(f"object is {len(data)} bytes, not {self.object_bytes}")
            self.format.parse(data[:HEADER_BYTES], key, self.payload_bytes)
        except ObjectCorrupt as e:
            self._corrupt(key, e)
            self.delete([key])
            return False
        with self._lock:
            if self._objects.get(key) is data:
                self._sound.add(key)
        return True

    def _read(self, request: Read, result: ReadResult) -> None:
        keys, host_blocks = request.keys, request.host_blocks
        checksums_out, headers_out = result.checksums, result.headers
        results = []
        for i, (key, block) in enumerate(zip(keys, host_blocks)):
            with self._lock:
                data = self._objects.get(key)
                authored = key in self._authored
                if data is not None:
                    self._objects.move_to_end(key)
            if data is None:
                results.append(False)
                continue
            view = memoryview(data)
            try:
                if len(data) != self.object_bytes:
                    raise ObjectCorrupt(f"object is {len(data)} bytes, not {self.object_bytes}")
                header, payload = view[:HEADER_BYTES], view[HEADER_BYTES:]
                self.format.check_or_defer(
                    header,
                    payload,
                    key,
                    checksums_out,
                    i,
                    mac=not authored,
                    headers_out=headers_out,
                )
            except ObjectCorrupt as e:
                self._corrupt(key, e)
                self.delete([key])
                results.append(False)
                continue
            block.numpy()[:] = np.frombuffer(data, dtype=np.uint8, offset=HEADER_BYTES)
            results.append(True)
        result.found[:] = results

    def get_into_scattered(self, keys, targets, go_on=None) -> list[bool]:
        self._check_scattered(keys, targets)
        results: list[bool] = []
        for key, views in zip(keys, targets):
            with self._lock:
                data = self._objects.get(key)
                authored = key in self._authored
            if data is None or not self._header_ok(key):
                break  # the prefix ends here: later keys are not read
            if go_on is not None:
                go_on(f"before copying object {len(results)} into its targets")
            offset = HEADER_BYTES
            for view in views:
                view[:] = data[offset : offset + len(view)]
                offset += len(view)
            try:
                length = offset - HEADER_BYTES
                self.format.check(data[:HEADER_BYTES], views, key, length, mac=not authored)
            except ObjectCorrupt as e:
                self._corrupt(key, e)
                self.delete([key])
                for view in views:
                    view[:] = bytes(len(view))
                break
            results.append(True)
        return self._count_gets(results + [False] * (len(keys) - len(results)))

    def put_from_scattered(self, keys, sources) -> list[bool]:
        self._check_scattered(keys, sources)
        for key, views in zip(keys, sources):
            if self._header_ok(key):
                continue
            payload = b"".join(bytes(v) for v in views)
            header = self.format.header(key, [payload])
            self._store(key, header + payload, sound=True)
        return self._count_puts([True] * len(keys))

    def put_from(self, keys, host_blocks, checksums=None, originals=None) -> list[bool]:
        self._check_batch(keys, host_blocks, checksums)
        if originals is not None:  # the same bytes where no peer can write them
            return self.put_from_scattered(keys, originals)
        for i, (key, block) in enumerate(zip(keys, host_blocks)):
            if self._header_ok(key):
                continue  # immutable: the stored object stays (a corrupt one is replaced)
            payload = block.numpy()
            known = checksums[i] if checksums is not None else None
            header = self.format.header(key, [payload], known)
            self._store(key, header + payload.tobytes(), sound=True)
        return self._count_puts([True] * len(keys))

    def _store(self, key: str, data: bytes, sound: bool = False) -> None:
        """``sound``: the header was built here (else it is checked when first looked up)."""
        with self._lock:
            old = self._objects.pop(key, None)
            self._used -= len(old) if old is not None else 0
            self._objects[key] = data
            self._used += len(data)
            if sound:
                self._sound.add(key)
                self._authored.add(key)
            else:
                self._sound.discard(key)
                self._authored.discard(key)
            evicted = []
            while self.capacity_bytes is not None and self._used > self.capacity_bytes:
                victim_key, victim = self._objects.popitem(last=False)
                self._used -= len(victim)
                self._sound.discard(victim_key)
                self._authored.discard(victim_key)
                evicted.append((victim_key, victim))
        if evicted:
            self.stats.add(evictions=len(evicted))
            if self._spill is not None:
                self._spill(evicted)
            self._evicted([victim_key for victim_key, _ in evicted])

    def delete(self, keys: Sequence[str]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                data = self._objects.pop(key, None)
                self._sound.discard(key)
                self._authored.discard(key)
                if data is not None:
                    self._used -= len(data)
                    removed += 1
        return removed

    def usage(self) -> StorageUsage:
        with self._lock:
            return StorageUsage(self._used, len(self._objects), self.capacity_bytes)

    def read_object(self, key: str) -> bytes | None:
        with self._lock:
            return self._objects.get(key)

    def write_object(self, key: str, data: bytes) -> None:
        self._store(key, bytes(data))
