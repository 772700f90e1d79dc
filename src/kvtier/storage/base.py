"""StorageBackend: the batch-first contract every storage tier implements — the interface only.

What a backend shares with the others (format, counters, the corrupt keys a load asks about,
the removal listener, argument checks) is the helper base ``kvtier.storage.object_store``; a
store that wraps another (the fault injector, a tier chain) is a ``kvtier.storage.wrappers.
delegating.Delegating``. Optional capabilities are Protocols a route requires by type
(``ScatteredIO``, ``Promotes``, ``StartsTransfers``), offered by ``scattered()``,
``promoter()`` and ``starts_transfers()``.

Contract (implementations do not repeat it):

- Keys are strings from ``kvtier.layout.keys.KeyScheme``; an object is immutable once stored.
- ``host_blocks`` are uint8 tensors of exactly ``spec.block_bytes`` bytes, normally
  ``HostPool.block(i)`` views. The caller owns them; a backend reads them during ``put_from``
  and writes them during ``get_into`` and keeps no reference afterwards. ``get_into`` may
  scribble on the block of a key it reports False: callers use only blocks reported True.
- ``exists_prefix(keys)`` -> how many *leading* keys are stored (stops at the first hole).
- ``read(Read(keys, host_blocks))`` -> a ``ReadResult`` whose ``found`` has one bool per key
  (``get_into(keys, host_blocks)``: that list): True iff that block now holds exactly the
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
  ``read(Read(..., verify=Verify.CHECKSUM_BY_CALLER))`` checks every header field but *not* the
  payload: a True then means "fetched, header valid, payload unverified", and the stored payload
  checksum is in ``ReadResult.checksums[i]``. The caller must verify the bytes before use (the
  worker does it inside the host->device copy with ``BlockCopier.swap_in_verified``) and report
  a mismatch with ``report_corrupt``.
- Bytes in memory a peer can write. Mooncake's transfer engine lets any peer write registered
  memory, so a check made there proves nothing about the bytes a later copy reads.
  ``Verify.ALL_BY_CALLER`` leaves the MAC to the caller as well: each True has a private copy
  of the header it checked in ``ReadResult.headers[i]``, and the
  caller copies the payload out of the registered memory first and then checks it where it
  lies with ``format.check_deferred`` (the MAC; the checksum where objects are not
  authenticated). A tier chain then promotes nothing itself: the caller hands the verified
  bytes to its ``promoter()`` (``kvtier.worker.routes``).
- ``Read(..., counted=False)``: a store's own read (a chain's writer reading back what it
  writes down), left out of the hit and miss counters, which count the engine's reads.
  Saves likewise: ``put_from(..., originals=...)`` names, per key, the same payload where no
  peer can write it (pieces, in order: a CPU device block, a private host block). The object's
  checksum and MAC are made over the originals, never over the registered block, and a backend
  that copies the payload anyway copies it from them; only a transfer that needs registered
  memory (Mooncake's) reads the host block. A peer that writes it meanwhile makes an object
  that fails its checks — a miss later, never its bytes under a valid MAC.
- ``scattered().get_into_scattered(keys, targets)`` (where ``scattered()`` is not None: a
  ``ScatteredIO``): like ``get_into``, but each key's payload lands in ``targets[i]``, a list of
  writable buffers filled in order (a CPU device block's per-layer pieces): one copy from
  storage straight into the engine's cache, verified right after it (while the bytes are still
  in the CPU cache).
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
``exists_prefix`` as its prefix-match query, and implements ``read`` / ``put_from`` on the host
block views. A store that can only read/write device memory directly subclasses this ABC and
overrides ``register_host_pool`` to receive the HostPool (and the DeviceCache through the worker)
so its SDK can target device addresses; the worker still answers with the prefix the backend
reports True. The checksummed object format is then the SDK's responsibility; kvtier only
requires that a False never becomes a True.
"""

from __future__ import annotations

import enum
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

if TYPE_CHECKING:
    from kvtier.layout.spec import KVCacheSpec
    from kvtier.storage.format import ObjectFormat

# Called with where a read stands before it writes an object into its targets; raises to stop it
# (``get_into_scattered``'s ``go_on``: the worker's deadline check).
GoOn = Callable[[str], None]


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


# ---- reads: one request type, one result type --------------------------------------------------


class Verify(enum.Enum):
    """Who checks a read's payload (the module docstring)."""

    HERE = "here"  # the backend: True means the block holds exactly the stored bytes
    CHECKSUM_BY_CALLER = "checksum"  # header checked; the payload checksum goes to the caller
    ALL_BY_CALLER = "all"  # header checked; checksum, MAC and a private header to the caller


@dataclass(frozen=True)
class Read:
    """Fill ``host_blocks[i]`` with ``keys[i]``'s payload, checked as ``verify`` says;
    ``counted``: False for a store's own read (not the engine's: left out of hits and misses)."""

    keys: Sequence[str]
    host_blocks: Sequence[torch.Tensor]
    verify: Verify = Verify.HERE
    counted: bool = True


@dataclass
class ReadResult:
    """What a ``Read`` found: ``found[i]`` (module docstring); where the caller verifies,
    ``checksums[i]`` (the stored payload checksum) and, with ``Verify.ALL_BY_CALLER``,
    ``headers[i]`` (a private copy of the header checked) for each True."""

    found: list[bool]
    checksums: np.ndarray | None = None
    headers: list[bytes | None] | None = None

    @classmethod
    def empty(cls, request: Read) -> ReadResult:
        """Nothing found yet, with room for what ``request.verify`` hands back."""
        n = len(request.keys)
        by_caller = request.verify is not Verify.HERE
        return cls(
            [False] * n,
            np.zeros(n, dtype=np.uint64) if by_caller else None,
            [None] * n if request.verify is Verify.ALL_BY_CALLER else None,
        )

    @property
    def leading(self) -> int:
        """How many leading keys were found (callers use that run only)."""
        return self.found.index(False) if False in self.found else len(self.found)


# ---- capabilities a route requires by type -----------------------------------------------------


@runtime_checkable
class ScatteredIO(Protocol):
    """Objects read straight into (and written from) a CPU device block's pieces: one copy
    instead of two (module docstring). ``covers_all``: whether every object of the store is
    reachable this way; False (a chain whose lower tiers read into host blocks only): a short
    read may have stopped at an object held where only ``read`` reaches."""

    @property
    def covers_all(self) -> bool: ...

    def get_into_scattered(
        self,
        keys: Sequence[str],
        targets: Sequence[Sequence[memoryview]],
        go_on: GoOn | None = None,
    ) -> list[bool]: ...

    def put_from_scattered(
        self, keys: Sequence[str], sources: Sequence[Sequence[memoryview]]
    ) -> list[bool]: ...


@runtime_checkable
class Promotes(Protocol):
    """A store that keeps what was loaded from its slower parts in its faster ones (a tier
    chain), given the bytes once the caller verified them: ``sources[i]`` is ``keys[i]``'s
    payload in pieces, after a read with ``Verify.ALL_BY_CALLER``."""

    def promote(self, keys: Sequence[str], sources: Sequence[Sequence[memoryview]]) -> None: ...


# Called exactly once when a started transfer ends: one bool per key (``get_into``'s or
# ``put_from``'s), or the exception that stopped it (``StartsTransfers``).
Done = Callable[[list[bool] | None, BaseException | None], None]


@runtime_checkable
class StartsTransfers(Protocol):
    """A store whose reads and writes run on its own threads and answer by calling back, from
    and into plain byte buffers: ``buffers[i]`` is a C-contiguous memoryview of format ``B``
    and exactly ``payload_bytes`` (writable for a read), the caller's until ``done``.
    ``start_read`` / ``start_write`` check the request and return; ``done(found, None)`` (or
    ``done(None, error)``) is then called once, on one of the store's threads, when every key
    is done, with ``get_into``'s and ``put_from``'s results and contract (a read is verified
    here, and counted). A caller with threads of its own (an engine's lower-tier tasks) hands
    a transfer to the store at once instead of to one of them, and waits for one hand-off
    fewer; and a buffer costs none of a tensor's checks and conversions (a few us a block).
    Raises, without calling ``done``, when the transfer cannot start."""

    def start_read(
        self, keys: Sequence[str], buffers: Sequence[memoryview], done: Done
    ) -> None: ...

    def start_write(
        self, keys: Sequence[str], buffers: Sequence[memoryview], done: Done
    ) -> None: ...


# ---- the interface -----------------------------------------------------------------------------


class StorageBackend(ABC):
    """One storage tier. See the module docstring for the contract."""

    kind: ClassVar[str] = "abstract"
    # ``exists_prefix`` answers from this process's memory in microseconds (no I/O, no lock
    # held across I/O): a worker then answers lookups on its loop thread, with no hand-off.
    quick_lookups: bool = False

    # What every store names (``ObjectStore`` sets them; a wrapper has its inner store's).
    spec: KVCacheSpec
    format: ObjectFormat  # how objects are laid out and checked (fingerprint, MAC key)
    stats: StorageStats
    payload_bytes: int  # a block's bytes
    object_bytes: int  # a stored object's: header and payload

    # ---- capabilities ------------------------------------------------------------------------

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

    def scattered(self) -> ScatteredIO | None:
        """Reads and writes of a CPU device block's pieces, where this store has them (the
        file and memory stores; a chain whose top tier has them); None: host blocks only."""
        return None

    def promoter(self) -> Promotes | None:
        """Who takes verified bytes after a ``Verify.ALL_BY_CALLER`` read (a tier chain);
        None: nothing to do with them."""
        return None

    def starts_transfers(self) -> StartsTransfers | None:
        """Reads and writes that answer by calling back, where this store runs them on
        threads of its own (the file store); None: ``read`` and ``put_from`` only."""
        return None

    @property
    def wrapped(self) -> StorageBackend:
        """The backend under any wrappers (the fault injector): itself for a backend."""
        return self

    # ---- data ----------------------------------------------------------------------------------

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
    def read(self, request: Read) -> ReadResult:
        """Fill the request's host blocks with its keys' payloads (module docstring). A miss is
        False, never an exception; a detected bad object is counted, logged once and removed."""

    def get_into(self, keys: Sequence[str], host_blocks: Sequence[torch.Tensor]) -> list[bool]:
        """``read`` verified here: one bool per key, True iff the block holds the stored bytes."""
        return self.read(Read(keys, host_blocks)).found

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

    # ---- bad objects and removals --------------------------------------------------------------

    @abstractmethod
    def found_corrupt(self, key: str) -> bool:
        """Was ``key`` found bad (and removed) since it was last asked about? (Forgets it.)"""

    @abstractmethod
    def report_corrupt(self, key: str, reason: str) -> None:
        """A caller found a fetched payload bad (deferred verification): count, log, remove."""

    @abstractmethod
    def watch_removals(self, listener: Callable[[list[str]], None]) -> None:
        """Tell ``listener`` the keys of objects this backend evicts for capacity, where it
        knows them (the file and memory stores; Mooncake evicts inside its master, unseen).
        Called on the thread that evicted, after the objects are gone; must not block."""

    def tier_stats(self) -> list[dict]:
        """Counters per tier of a chain, fastest first (``tier``, ``backend``, counts). One
        backend: none (its ``stats`` are the store's)."""
        return []

    # ---- resources -----------------------------------------------------------------------------

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
