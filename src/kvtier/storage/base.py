"""StorageBackend: the batch-first contract every storage tier implements.

Contract (implementations do not repeat it):

- Keys are strings from ``kvtier.layout.keys.KeyScheme``; an object is immutable once stored.
- ``host_blocks`` are uint8 tensors of exactly ``spec.block_bytes`` bytes, normally
  ``HostPool.block(i)`` views. The caller owns them; a backend reads them during ``put_from``
  and writes them during ``get_into`` and keeps no reference afterwards. ``get_into`` may
  scribble on the block of a key it reports False: callers use only blocks reported True.
- ``exists_prefix(keys)`` -> how many *leading* keys are stored (stops at the first hole).
- ``get_into(keys, host_blocks)`` -> one bool per key: True iff that block now holds exactly the
  bytes that were stored. Missing, evicted, truncated, corrupted (checksum), written under
  another layout (fingerprint) or under another key: False — a miss, never wrong data. A
  detected bad object is counted in ``stats.corrupt``, logged once and removed. Callers take
  the leading run of True.
- ``put_from(keys, host_blocks)`` -> one bool per key: True iff the object is now stored
  (including when it already was: a put of an existing key is a no-op and keeps the old
  object). A failed or interrupted put is never visible to ``exists_prefix`` or ``get_into``.
- Checksums from the copy: ``put_from(..., checksums=[...])`` takes each block's XXH3-64 when
  the caller already knows it (``HostPool.known_checksums``, recorded by the copier while it wrote
  the block; ``None`` entries are hashed here), saving a pass over the bytes.
  ``get_into(..., checksums_out=array)`` checks every header field but *not* the payload: a True
  then means "fetched, header valid, payload unverified", and the stored payload checksum is
  written to ``checksums_out[i]``. The caller must verify the bytes before use (the worker does
  it inside the host->device copy with ``BlockCopier.swap_in_verified``) and report a mismatch
  with ``report_corrupt``.
- Bytes in memory a peer can write. Mooncake's transfer engine lets any peer write registered
  memory, so a check made there proves nothing about the bytes a later copy reads.
  ``get_into(..., checksums_out=..., headers_out=[None] * n)`` leaves the MAC to the caller as
  well: each True has a private copy of the header it checked in ``headers_out[i]``, and the
  caller copies the payload out of the registered memory first and then checks it where it
  lies with ``format.check_deferred`` (the MAC; the checksum where objects are not
  authenticated). A tier chain then promotes nothing itself: the caller calls
  ``promote(keys, sources)`` with the verified bytes (``kvtier.worker.routes``).
  Saves likewise: ``put_from(..., originals=...)`` names, per key, the same payload where no
  peer can write it (pieces, in order: a CPU device block, a private host block). The object's
  checksum and MAC are made over the originals, never over the registered block, and a backend
  that copies the payload anyway copies it from them; only a transfer that needs registered
  memory (Mooncake's) reads the host block. A peer that writes it meanwhile makes an object
  that fails its checks — a miss later, never its bytes under a valid MAC.
- ``get_into_scattered(keys, targets)`` (backends with ``supports_scattered_reads``): like
  ``get_into``, but each key's payload lands in ``targets[i]``, a list of writable buffers
  filled in order (a CPU device block's per-layer pieces): one copy from storage straight into
  the engine's cache, verified right after it (while the bytes are still in the CPU cache).
  True: the target holds exactly the stored object. False: missing (target untouched) or it
  failed a check — then the target is zeroed, so bytes that failed never stay there. Reads stop
  at the first False (the caller uses the leading run only): later keys are False and their
  targets untouched, except one a parallel I/O thread had already begun (which then holds
  verified bytes of its own key, or zeros). ``go_on`` (optional) is called with where the read
  stands before any object's bytes are written into its targets; it raises (the worker's
  ``DeadlinePassed``: the engine may have reused those blocks) to stop the read, and the
  exception propagates — later objects are not read (but for one a parallel thread had begun).
  ``put_from_scattered(keys, sources)`` is the same for saves: each object's payload is read
  from ``sources[i]`` in order (hashed here), with ``put_from``'s results.
- ``delete(keys)`` -> number of objects removed; missing keys are ignored.
- ``found_corrupt(key)`` -> was ``key`` found bad (and removed) since it was last asked about.
  A load that stops at such an object drops the objects after it in that load: they were not
  verified, and a put keeps a stored object whose header is sound, so the caller's save of the
  recomputed blocks would otherwise leave them (each later load finding the next bad one).
- ``usage()`` -> StorageUsage; ``close()`` releases everything; backends are context managers.
- Every method is thread-safe. A backend that cannot be reached at all raises
  ``StorageUnavailable`` (callers answer "0 blocks" and carry on); per-key failures are False,
  not exceptions. Bad arguments (length mismatch, wrong block size) raise ``StorageError``.
- ``read_object`` / ``write_object`` give raw access to the stored bytes (header included) for
  inspection tools and fault injection; ``write_object`` bypasses immutability on purpose.

Token-addressed backends. Some stores are addressed by token ids rather than block keys and
move bytes to and from device memory themselves (the closed AttentionStore SDK of the system
kvtier replaces did this). Such a backend plugs in behind this same interface: it derives its
own address from the key (``KeyScheme.key`` carries the chained block hash, which identifies the
token prefix exactly; a worker can pass token ids alongside through its task), implements
``exists_prefix`` as its prefix-match query, and implements ``get_into`` / ``put_from`` on the host
block views. A store that can only read/write device memory directly subclasses this ABC and
overrides ``register_host_pool`` to receive the HostPool (and the DeviceCache through the worker)
so its SDK can target device addresses; the worker still answers with the prefix the backend
reports True. The checksummed object format is then the SDK's responsibility; kvtier only
requires that a False never becomes a True.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.errors import ObjectCorrupt, StorageError
from kvtier.layout.spec import KVCacheSpec
from kvtier.storage.format import HEADER_BYTES, ObjectFormat

# Called with where a read stands before it writes an object into its targets; raises to stop it
# (``get_into_scattered``'s ``go_on``: the worker's deadline check).
GoOn = Callable[[str], None]

# Bad keys kept for a load to ask about (it asks at once: a few suffice; bounded all the same).
REMEMBERED_CORRUPT_KEYS = 1024

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StorageUsage:
    used_bytes: int
    num_objects: int
    capacity_bytes: int | None  # None: unbounded or unknown


@dataclass
class StorageStats:
    """Counters a backend keeps; read them, don't write them."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    puts: int = 0
    put_failures: int = 0
    evictions: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in vars(self).items() if k != "lock"}


class StorageBackend(ABC):
    """One storage tier. See the module docstring for the contract."""

    kind: str = "abstract"
    # ``exists_prefix`` answers from this process's memory in microseconds (no I/O, no lock
    # held across I/O): a worker then answers lookups on its loop thread, with no hand-off.
    quick_lookups: bool = False

    def __init__(self, spec: KVCacheSpec, mac_key: bytes | None = None) -> None:
        self.spec = spec
        self.fingerprint = spec.fingerprint
        self.format = ObjectFormat(spec.fingerprint, mac_key)
        self.payload_bytes = spec.block_bytes
        self.object_bytes = HEADER_BYTES + spec.block_bytes
        self.stats = StorageStats()
        self._found_corrupt: OrderedDict[str, None] = OrderedDict()  # until a load asks
        self._removal_listener: Callable[[list[str]], None] | None = None

    # ---- removals the backend decides itself ---------------------------------------------------

    def watch_removals(self, listener: Callable[[list[str]], None]) -> None:
        """Tell ``listener`` the keys of objects this backend evicts for capacity, where it
        knows them (the file and memory stores; Mooncake evicts inside its master, unseen).
        Called on the thread that evicted, after the objects are gone; must not block."""
        self._removal_listener = listener

    def _evicted(self, keys: list[str]) -> None:
        if keys and self._removal_listener is not None:
            self._removal_listener(keys)

    @property
    def wrapped(self) -> StorageBackend:
        """The backend under any wrappers (the fault injector): itself for a backend."""
        return self

    # ---- capabilities: every backend states them -------------------------------------------

    @property
    @abstractmethod
    def supports_scattered_reads(self) -> bool:
        """Whether ``get_into_scattered`` / ``put_from_scattered`` work: objects read straight
        into (and written from) a CPU device block's pieces, one copy instead of two."""

    @property
    def reads_scattered_on_top(self) -> bool:
        """Whether ``get_into_scattered`` / ``put_from_scattered`` work for the objects this
        store serves first: a tier chain whose top tier reads scattered over one that does not
        (memory over Mooncake) answers a block held only below as not found, for the caller to
        read through host blocks (``kvtier.worker.routes``). One backend: its own capability."""
        return self.supports_scattered_reads

    @property
    @abstractmethod
    def exposes_registered_memory(self) -> bool:
        """Whether registered memory is readable by the backend's peers (Mooncake's transfer
        engine serves reads of it without authentication): callers then register only the
        blocks the backend must reach (a worker: its staging) and move others through them."""

    @property
    @abstractmethod
    def persistent(self) -> bool:
        """Whether objects outlive the process that stored them (the file store: on disk;
        Mooncake: while its cluster runs; the memory store: no)."""

    # ---- the contract (module docstring) -----------------------------------------------------

    @abstractmethod
    def exists_prefix(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are stored with a sound header (stops at the first hole).
        Reads no payload. Raises StorageUnavailable when the store cannot be reached."""

    def holds(self, key: str) -> bool:
        """Whether ``key`` is stored, from what this process knows without a request where it
        can (a tier chain asks its other tiers this when one evicts: must not block long)."""
        return self.exists_prefix([key]) == 1

    def prefix_tiers(self, keys: Sequence[str]) -> tuple[int, bytes]:
        """``exists_prefix(keys)``, and the tier (0 = the fastest) each of those blocks would
        load from, one byte each; empty when all come from the first (one backend: always)."""
        return self.exists_prefix(keys), b""

    @abstractmethod
    def get_into(
        self,
        keys: Sequence[str],
        host_blocks: Sequence[torch.Tensor],
        checksums_out: np.ndarray | None = None,
        headers_out: list[bytes | None] | None = None,
    ) -> list[bool]:
        """Fill ``host_blocks[i]`` with ``keys[i]``'s payload; one bool per key, True iff the
        block holds exactly the stored bytes (verified; with ``checksums_out``: header checked,
        payload checksum written there for the caller to verify; with ``headers_out`` too, the
        MAC left to the caller, see the module docstring). A miss is False, never an
        exception; a detected bad object is counted, logged once and removed."""

    @abstractmethod
    def put_from(
        self,
        keys: Sequence[str],
        host_blocks: Sequence[torch.Tensor],
        checksums: Sequence[int | None] | None = None,
        originals: Sequence[Sequence[memoryview]] | None = None,
    ) -> list[bool]:
        """Store ``host_blocks[i]`` under ``keys[i]`` (``checksums[i]``: its XXH3-64 when the
        caller knows it; ``originals[i]``: the same bytes where no peer can write them, see the
        module docstring); one bool per key, True iff the object is now stored (an existing key
        is kept as it is). A failed or interrupted put is never visible to readers."""

    def promote(self, keys: Sequence[str], sources: Sequence[Sequence[memoryview]]) -> None:  # noqa: B027
        """Bytes the caller verified after a ``get_into(..., headers_out=...)`` (``sources[i]``:
        ``keys[i]``'s payload in pieces): a tier chain puts those it loaded from below into
        its top tier. One backend: nothing to do."""

    def get_into_scattered(
        self,
        keys: Sequence[str],
        targets: Sequence[Sequence[memoryview]],
        go_on: GoOn | None = None,
    ) -> list[bool]:
        """See the module docstring; only where ``supports_scattered_reads``."""
        raise NotImplementedError(f"the {self.kind} backend reads into host blocks only")

    def put_from_scattered(
        self, keys: Sequence[str], sources: Sequence[Sequence[memoryview]]
    ) -> list[bool]:
        """See the module docstring; only where ``supports_scattered_reads``."""
        raise NotImplementedError(f"the {self.kind} backend writes from host blocks only")

    def _check_scattered(self, keys: Sequence[str], targets, sizes: bool = True) -> None:
        """``sizes=False``: the lengths only (a tier chain, whose first live tier is handed
        every target and checks their sizes itself)."""
        if len(keys) != len(targets):
            raise StorageError(f"{len(keys)} keys but {len(targets)} targets")
        for i, views in enumerate(targets if sizes else ()):
            if sum(map(len, views)) != self.payload_bytes:  # map: no Python frame per view
                raise StorageError(f"target {i} holds {sum(map(len, views))} bytes")

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> int:
        """Remove the objects of ``keys``; how many were removed (missing keys are ignored)."""

    @abstractmethod
    def usage(self) -> StorageUsage:
        """Bytes and objects held now, and the capacity (None: unbounded or unknown)."""

    @abstractmethod
    def read_object(self, key: str) -> bytes | None:
        """The raw stored bytes of ``key`` (header included), or None: for inspection tools
        and fault injection, not the data path."""

    @abstractmethod
    def write_object(self, key: str, data: bytes) -> None:
        """Store raw bytes under ``key``, replacing what is there (bypasses immutability on
        purpose: fault injection and repair tools)."""

    def found_corrupt(self, key: str) -> bool:
        """Was ``key`` found bad (and removed) since it was last asked about? (Forgets it.)"""
        with self.stats.lock:
            if key not in self._found_corrupt:
                return False
            del self._found_corrupt[key]
            return True

    def report_corrupt(self, key: str, reason: str) -> None:
        """A caller found a fetched payload bad (deferred verification): count, log, remove."""
        self._corrupt(key, ObjectCorrupt(reason))
        self.delete([key])

    def tier_stats(self) -> list[dict]:
        """Counters per tier of a chain, fastest first (``tier``, ``backend``, counts). One
        backend: none (its ``stats`` are the store's)."""
        return []

    def register_host_pool(self, pool, blocks: range | None = None) -> None:  # noqa: B027
        """Called once per HostPool before it is used; zero-copy backends register ``blocks``
        of it (None: all) and then read and write only those."""

    def unregister_host_pool(self, pool) -> None:  # noqa: B027 - optional hook
        """Called before a registered HostPool is freed."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections, threads and registrations."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers for implementations --------------------------------------------------------

    def _check_batch(
        self,
        keys: Sequence[str],
        host_blocks: Sequence[torch.Tensor],
        extra=None,
        headers=None,
        blocks: bool = True,
    ) -> None:
        """``blocks=False``: the lengths only (a tier chain, whose first live tier is handed
        every block and key and checks them itself)."""
        if len(keys) != len(host_blocks):
            raise StorageError(f"{len(keys)} keys but {len(host_blocks)} host blocks")
        if extra is not None and len(extra) != len(keys):
            raise StorageError(f"{len(keys)} keys but {len(extra)} checksums")
        if headers is not None and (extra is None or len(headers) != len(keys)):
            raise StorageError(
                f"headers_out needs checksums_out and one entry per key ({len(keys)} keys)"
            )
        if not blocks:
            return
        for i, block in enumerate(host_blocks):
            if block.dtype != torch.uint8 or block.numel() != self.payload_bytes:
                raise StorageError(
                    f"host block {i} is {block.numel()} x {block.dtype}; need "
                    f"{self.payload_bytes} x torch.uint8 (HostPool.block(i))"
                )
            if not block.is_contiguous() or block.device.type != "cpu":
                raise StorageError(f"host block {i} must be a contiguous CPU tensor")
        for key in keys:
            if not isinstance(key, str) or not key:
                raise StorageError(f"keys must be non-empty strings, got {key!r}")

    def _corrupt(self, key: str, error: ObjectCorrupt) -> None:
        """Count and log a detected bad object once; the caller removes it."""
        self.stats.add(corrupt=1)
        with self.stats.lock:
            self._found_corrupt[key] = None
            while len(self._found_corrupt) > REMEMBERED_CORRUPT_KEYS:
                self._found_corrupt.popitem(last=False)
        log.warning(
            "%s store: object %s is corrupt (%s): treated as a miss and removed",
            self.kind,
            key,
            error,
        )

    def _count_gets(self, results: list[bool]) -> list[bool]:
        hits = sum(results)
        self.stats.add(hits=hits, misses=len(results) - hits)
        return results

    def _count_puts(self, results: list[bool]) -> list[bool]:
        ok = sum(results)
        self.stats.add(puts=ok, put_failures=len(results) - ok)
        return results
