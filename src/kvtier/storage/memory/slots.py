"""The memory tier's slot table: which key holds which slot, least recently used first, and
which slots reads still hold (pinned).

A slot whose key is removed or replaced while a read copies out of it is freed only when the
last such read ends, so a reader never sees another object's bytes appear under it. Eviction
takes the least recently used slot that no read holds; when every slot is held it waits a
moment for one (a read takes milliseconds at most).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

WAIT_FOR_A_SLOT_S = 0.01  # every slot held by reads: look again after this


class Slots:
    def __init__(self, count: int) -> None:
        self.lock = threading.Condition()  # the table's; the store's compound steps take it too
        self._by_key: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._free = list(range(count - 1, -1, -1))
        self._pins = [0] * count  # reads in flight per slot
        self._dropped: set[int] = set()  # no key any more, but pinned: free once reads end
        self.lengths = np.zeros(count, dtype=np.int64)  # bytes written (a short one: corrupt)

    def __len__(self) -> int:
        with self.lock:
            return len(self._by_key)

    def of(self, key: str) -> int | None:
        """The slot holding ``key`` (under ``lock`` where it must stay so)."""
        return self._by_key.get(key)

    def take(self) -> tuple[int, str | None]:
        """A slot no key maps to and no read holds — a free one, or the least recently used
        one, evicted — and the key it held (None: it was free). The slot is the caller's until
        it publishes it: its old bytes (``lengths``) stay until the caller writes over them."""
        with self.lock:
            while not self._free:
                victim = next((k for k, s in self._by_key.items() if not self._pins[s]), None)
                if victim is None:
                    self.lock.wait(WAIT_FOR_A_SLOT_S)
                    continue
                return self._by_key.pop(victim), victim
            return self._free.pop(), None

    def publish(self, key: str, slot: int, length: int) -> None:
        """``key`` now lives in ``slot`` (``length`` bytes), most recently used; the slot it
        lived in before is released (under ``lock``: the store publishes what it knows of the
        object with it)."""
        old = self._by_key.pop(key, None)
        if old is not None:
            self._release(old)
        self._by_key[key] = slot
        self.lengths[slot] = length

    def remove(self, key: str) -> bool:
        """``key`` leaves the table (under ``lock``); a read still holding its slot finishes."""
        slot = self._by_key.pop(key, None)
        if slot is not None:
            self._release(slot)
        return slot is not None

    def pin(self, keys: Sequence[str], prefix: bool) -> list[tuple[int, int]]:
        """(index, slot) of each of ``keys`` stored, each slot held for a read and made most
        recently used; ``prefix``: stop at the first key not stored."""
        pinned = []
        with self.lock:  # one acquisition for the batch
            for i, key in enumerate(keys):
                slot = self._by_key.get(key)
                if slot is None:
                    if prefix:
                        break
                    continue
                self._by_key.move_to_end(key)
                self._pins[slot] += 1
                pinned.append((i, slot))
        return pinned

    def unpin(self, slots: Iterable[int]) -> None:
        """The reads of ``slots`` ended (one acquisition for the batch)."""
        with self.lock:
            for slot in slots:
                self._pins[slot] -= 1
                if not self._pins[slot] and slot in self._dropped:
                    self._dropped.discard(slot)
                    self._free.append(slot)
            self.lock.notify_all()

    def _release(self, slot: int) -> None:
        """``slot`` holds no key any more: free now, or once its reads end."""
        if self._pins[slot]:
            self._dropped.add(slot)
        else:
            self._free.append(slot)
