"""What kvtier holds, as vLLM KV events: routers (vllm-router, llm-d, Dynamo) see the storage
tier beside vLLM's own GPU blocks.

Each rank's worker side records, from its kvtier worker's answers, the blocks a save stored and
the blocks the store removed (evicted, or all of them after a weight update: ``Result.removed``,
``all_removed``). vLLM carries these reports to the scheduler side (``KvtierKVEvents``, through
``get_kv_connector_kv_cache_events``), where ``TierEvents`` turns them into vLLM's own
``BlockStored`` / ``BlockRemoved`` events, which ``take_events`` hands to vLLM's publisher
(``--kv-events-config``):

- a block is stored once **every** TP rank stored its part (a router may send a request there);
- it is removed once **any** rank lost its part;
- ``medium`` is ``STORAGE`` (vLLM's name for a storage tier), ``ownership`` names the backend
  (``kvtier:file``); hashes are vLLM's own (``maybe_convert_block_hash``, as its GPU events);
- events carry block hashes only, never tokens (``token_ids`` is empty): the socket is readable
  by whoever can connect, and a router keys its index by hash.

Published only where vLLM's publisher does not listen on every interface: its default
``tcp://*:5557`` binds all of them, while a host endpoint (``tcp://127.0.0.1:5557``) makes it
connect to the router listening there, and ``ipc://`` binds a socket file. ``kv_events`` in
``kv_connector_extra_config`` (``auto`` | ``off`` | ``any_interface``) says otherwise. A TCP
endpoint is warned about once: any local user can bind a loopback port before the router
does (and read vLLM's own events, whose GPU-tier events carry token ids) or connect to the
router's (and forge events); an ``ipc://`` path in a 0700 directory is for the owner only.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

log = logging.getLogger(__name__)

MAX_TRACKED_BLOCKS = 1 << 21  # announced blocks remembered: past it the oldest is announced gone
WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")


@dataclass
class RankReport:
    """One kvtier answer's news from one rank."""

    rank: int
    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)
    all_removed: bool = False


class KvtierKVEvents(KVConnectorKVEvents):
    """The reports of every rank since the last step, as vLLM carries them to the scheduler."""

    def __init__(self, reports: list[RankReport] | None = None) -> None:
        self.reports = list(reports or [])
        self.workers = 1

    def add_events(self, events: list[Any]) -> None:
        self.reports.extend(events)

    def aggregate(self) -> KvtierKVEvents:
        return self  # every report counts: ranks answer in different steps

    def increment_workers(self, count: int = 1) -> None:
        self.workers += count

    def get_all_events(self) -> list[Any]:
        return list(self.reports)

    def get_number_of_workers(self) -> int:
        return self.workers

    def clear_events(self) -> None:
        self.reports = []


class RankEventLog:
    """A worker side's reports, from the client's I/O thread to vLLM's step."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._reports: list[RankReport] = []

    def add(self, stored: list[bytes], removed: list[bytes], all_removed: bool) -> None:
        if stored or removed or all_removed:
            with self._lock:
                self._reports.append(RankReport(self.rank, stored, removed, all_removed))

    def take(self) -> KvtierKVEvents | None:
        with self._lock:
            reports, self._reports = self._reports, []
        return KvtierKVEvents(reports) if reports else None


class TierEvents:
    """The scheduler side: ranks' reports in, vLLM KV events out (see the module's rules)."""

    def __init__(self, world_size: int, block_size: int, backend: str) -> None:
        self.world_size, self.block_size = world_size, block_size
        self.ownership = f"kvtier:{backend}"
        self._partial: OrderedDict[bytes, set[int]] = OrderedDict()  # stored on some ranks
        self._announced: OrderedDict[bytes, None] = OrderedDict()
        self._events: list[KVCacheEvent] = []

    def add(self, reports: list[RankReport]) -> None:
        """Each report in the order its worker means it: everything earlier gone (a weight
        update), then the blocks stored, then the blocks removed (evicted, possibly by that very
        save; or stored under the version just retired)."""
        for report in reports:
            if report.all_removed and self._announced:
                self._events.append(self._removed(list(self._announced)))
                self._announced.clear()
                self._partial.clear()
            stored = [h for h in report.stored if self._stored_on(h, report.rank)]
            if stored:
                self._events.append(self._stored(stored))
            gone: list[bytes] = []
            for h in report.removed:
                self._partial.pop(h, None)
                if h in self._announced:
                    del self._announced[h]
                    gone.append(h)
            while len(self._announced) > MAX_TRACKED_BLOCKS:
                gone.append(self._announced.popitem(last=False)[0])
            if gone:
                self._events.append(self._removed(gone))

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def _stored_on(self, block_hash: bytes, rank: int) -> bool:
        """Note that ``rank`` stored ``block_hash``; True when every rank now has."""
        if block_hash in self._announced:
            return False
        ranks = self._partial.setdefault(block_hash, set())
        ranks.add(rank)
        if len(ranks) < self.world_size:
            while len(self._partial) > MAX_TRACKED_BLOCKS:
                self._partial.popitem(last=False)
            return False
        del self._partial[block_hash]
        self._announced[block_hash] = None
        return True

    def _stored(self, hashes: list[bytes]) -> BlockStored:
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(BlockHash(h)) for h in hashes],
            parent_block_hash=None,
            token_ids=[],
            block_size=self.block_size,
            lora_id=None,
            medium=MEDIUM_STORAGE,
            lora_name=None,
            ownership=self.ownership,
        )

    def _removed(self, hashes: list[bytes]) -> BlockRemoved:
        return BlockRemoved(
            block_hashes=[maybe_convert_block_hash(BlockHash(h)) for h in hashes],
            medium=MEDIUM_STORAGE,
            ownership=self.ownership,
        )


def publishing(vllm_config: Any, setting: str, warn: bool = False) -> bool:
    """Should kvtier add its events to vLLM's publisher? With ``warn`` (the scheduler side,
    once), says why not where it matters."""
    config = getattr(vllm_config, "kv_events_config", None)
    if setting == "off" or config is None or not config.enable_kv_cache_events:
        return False
    if config.publisher != "zmq" or setting == "any_interface":
        return True
    host = str(config.endpoint).split("://", 1)[-1].rsplit(":", 1)[0]
    if host in WILDCARD_HOSTS:
        if not warn:
            return False
        log.warning(
            "kvtier: vLLM's KV-events publisher binds every interface (%s): kvtier adds what "
            "it stores only to a publisher that does not — set kv_events_config's endpoint to "
            "the router's address (tcp://HOST:PORT: vLLM connects to the router) or an ipc:// "
            "path, or kv_connector_extra_config kv_events: any_interface to accept it",
            config.endpoint,
        )
        return False
    if warn and str(config.endpoint).startswith("tcp://"):
        log.warning(
            "kvtier: vLLM's KV events go to %s, a TCP port any local user can bind first "
            "(and then receive vLLM's events, token ids of its GPU blocks included) or connect "
            "to (and send the router forged events): for a router on this host, prefer an "
            "ipc:// endpoint in a directory only you can enter (for example "
            "ipc://$XDG_RUNTIME_DIR/kv-events, 0700)",
            config.endpoint,
        )
    return True
