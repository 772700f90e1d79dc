"""FaultInjectingStore: wraps any backend with latency, errors, corruption and outages.

Configured like a real backend (``{"backend": "file", ..., "faults": {...}}``), for the
reliability suite and for operators rehearsing failures. Every injected fault is counted in
``injected`` so tests can compare detections with injections.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.errors import StorageUnavailable
from kvtier.storage.base import Read, ReadResult, ScatteredIO, StorageBackend
from kvtier.storage.config import FaultConfig
from kvtier.storage.object_store import check_batch, check_scattered
from kvtier.storage.wrappers.delegating import Delegating


class FaultInjectingStore(Delegating):
    kind = "faults"

    def __init__(self, inner: StorageBackend, config: FaultConfig | Mapping[str, Any]):
        super().__init__(inner)
        self.config = config if isinstance(config, FaultConfig) else FaultConfig.from_dict(config)
        self.injected: Counter[str] = Counter()
        self._rng = random.Random(self.config.seed)
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._forced_unavailable = False

    @property
    def quick_lookups(self) -> bool:  # type: ignore[override]
        return False  # its lookups sleep, stall and fail by design: never on a worker's loop

    def set_unavailable(self, unavailable: bool) -> None:
        """Switch an outage on or off by hand (in addition to the configured window)."""
        self._forced_unavailable = unavailable

    def _enter(self, what: str) -> None:
        if self.config.latency_s:
            time.sleep(self.config.latency_s)
        if self.config.transfer_latency_s and what in ("get_into", "put_from"):
            time.sleep(self.config.transfer_latency_s)
        if what == "get_into" and self._roll(self.config.stall_rate):
            with self._lock:
                self.injected["stall"] += 1
            time.sleep(self.config.stall_s)
        start = self.config.unavailable_after_s
        elapsed = time.monotonic() - self._started
        in_window = start is not None and start <= elapsed < start + self.config.unavailable_for_s
        flagged = self.config.unavailable_while is not None and os.path.lexists(
            self.config.unavailable_while
        )
        if self._forced_unavailable or in_window or flagged:
            with self._lock:
                self.injected["unavailable"] += 1
            raise StorageUnavailable(f"injected outage ({what})")

    def _roll(self, rate: float) -> bool:
        if rate <= 0.0:
            return False
        with self._lock:
            return self._rng.random() < rate

    def exists_prefix(self, keys: Sequence[str]) -> int:
        self._enter("exists_prefix")
        return self.inner.exists_prefix(keys)

    def prefix_tiers(self, keys: Sequence[str]) -> tuple[int, bytes]:
        self._enter("exists_prefix")  # a lookup, as the worker makes it
        return self.inner.prefix_tiers(keys)

    def read(self, request: Read) -> ReadResult:
        check_batch(request.keys, request.host_blocks, self.payload_bytes)
        self._enter("get_into")
        result = self.inner.read(request)
        self._drop_some(result.found)
        return result

    def scattered(self) -> ScatteredIO | None:
        return self if self.inner.scattered() is not None else None  # ScatteredIO, faulty

    @property
    def covers_all(self) -> bool:
        io = self.inner.scattered()
        return io is not None and io.covers_all

    def _scattered(self) -> ScatteredIO:
        io = self.inner.scattered()
        if io is None:
            raise NotImplementedError(f"the {self.inner.kind} backend reads into host blocks only")
        return io

    def get_into_scattered(self, keys, targets, go_on=None) -> list[bool]:
        check_scattered(keys, targets, self.payload_bytes)
        self._enter("get_into")  # a stall here is seen by the inner store's go_on
        return self._drop_some(self._scattered().get_into_scattered(keys, targets, go_on))

    def put_from_scattered(self, keys, sources) -> list[bool]:
        check_scattered(keys, sources, self.payload_bytes)
        self._enter("put_from")
        fail = [self._roll(self.config.error_rate) for _ in keys]
        chosen = [i for i, f in enumerate(fail) if not f]
        stored = self._scattered().put_from_scattered(
            [keys[i] for i in chosen], [sources[i] for i in chosen]
        )
        return self._merge_puts(keys, fail, chosen, stored)

    def _drop_some(self, results: list[bool]) -> list[bool]:
        """Injected read errors: each hit becomes a miss with probability ``error_rate``."""
        for i, ok in enumerate(results):
            if ok and self._roll(self.config.error_rate):
                results[i] = False
                with self._lock:
                    self.injected["get_error"] += 1
        return results

    def put_from(self, keys, host_blocks, checksums=None, originals=None) -> list[bool]:
        check_batch(keys, host_blocks, self.payload_bytes, checksums)
        if originals is not None:
            check_scattered(keys, originals, self.payload_bytes)
        self._enter("put_from")
        fail = [self._roll(self.config.error_rate) for _ in keys]
        chosen = [i for i, f in enumerate(fail) if not f]
        stored = self.inner.put_from(
            [keys[i] for i in chosen],
            [host_blocks[i] for i in chosen],
            None if checksums is None else [checksums[i] for i in chosen],
            None if originals is None else [originals[i] for i in chosen],
        )
        return self._merge_puts(keys, fail, chosen, stored)

    def _merge_puts(self, keys, fail: list[bool], chosen: list[int], stored) -> list[bool]:
        """Results of a put whose ``chosen`` keys reached the inner store; injected corruption
        of some of what it stored."""
        results = [False] * len(keys)
        for i, ok in zip(chosen, stored):
            results[i] = ok
            if ok and self._roll(self.config.corrupt_rate):
                self.flip_bit(keys[i])
        with self._lock:
            self.injected["put_error"] += sum(fail)
        return results

    def flip_bit(self, key: str, bit: int | None = None) -> bool:
        """Flip one bit (random unless given) of the stored object; False if it is missing."""
        data = self.inner.read_object(key)
        if data is None:
            return False
        with self._lock:
            position = self._rng.randrange(len(data) * 8) if bit is None else bit
            self.injected["corrupt"] += 1
        corrupted = bytearray(data)
        corrupted[position // 8] ^= 1 << (position % 8)
        self.inner.write_object(key, bytes(corrupted))
        return True

    def delete(self, keys: Sequence[str]) -> int:
        self._enter("delete")
        return self.inner.delete(keys)
