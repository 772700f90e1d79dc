"""Looking at and tidying a file store from outside: what ``kvtier store`` runs.

The root is walked from ``/`` as the workers walk it (``kvtier.common.user_dirs``: a root or a
directory on the way that another user controls is refused), and the store's directories are
held open (``StoreTree``): every entry is listed, opened and unlinked relative to the descriptor
of the directory it was found in, never by path, so that nothing renamed or linked after the
scan leads a removal outside the store.

Safe beside live workers: objects are read through their own descriptors (``O_NOFOLLOW``, no
blocking, regular files only) and removed with one ``unlink`` each — a load that already opened
the object reads it to the end, a later one misses. Nothing outside the store's own layout
(``objects/<2 hex>/<64 hex>.kvb``) is ever removed; anything else found there is reported as
foreign and left alone.

An object says what it is: its header (layout fingerprint, payload length, checksums) and, since
the key trailer, its storage key (namespace, weight version, rank). Objects written before the
trailer existed count under namespace ``?``.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import re
import stat
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvtier.common.user_dirs import DIR_FLAGS, open_user_directory
from kvtier.errors import ObjectCorrupt, StorageError
from kvtier.layout.keys import KeyParts, KeyScheme
from kvtier.storage.file.dirs import TMP_NAME
from kvtier.storage.format import (
    HEADER_BYTES,
    MAC_BYTES,
    PLAIN,
    Header,
    ObjectFormat,
    read_header,
)

OBJECT_NAME = re.compile(r"[0-9a-f]{64}\.kvb")
FANOUT_NAME = re.compile(r"[0-9a-f]{2}")
UNKNOWN = "?"
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # never a link or a FIFO
READ_CHUNK = 8 << 20  # verification reads and hashes this much at a time, whatever the object
# No KV block of any layout comes near this (a 128-token block of an 80-layer, 8-head bf16 model
# is 42 MB): a header that claims more is corrupt, whatever the file's (sparse) size says.
MAX_PAYLOAD_BYTES = 1 << 30


@dataclass
class StoredObject:
    """One entry under ``objects/``: an object (``header`` set) or something else."""

    path: Path
    size: int
    mtime: float
    header: Header | None = None
    key: str | None = None
    parts: KeyParts | None = None
    problem: str | None = None  # why it is corrupt (an object) or foreign (anything else)
    foreign: bool = False
    dir_fd: int | None = None  # the directory it was listed in (a StoreTree's): opened from it

    @property
    def namespace(self) -> str:
        return self.parts.namespace if self.parts else UNKNOWN

    @property
    def version(self) -> str:
        return self.parts.version if self.parts else UNKNOWN

    @property
    def fingerprint(self) -> str:
        return self.header.fingerprint if self.header else UNKNOWN


class StoreTree:
    """A file store's root, walked as the workers walk it, and its directories held open until
    ``close``: what is listed is opened and removed relative to them."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(os.path.abspath(os.path.expanduser(root)))
        self._fds: list[int] = []
        fd, _ = open_user_directory(self.root, 0o700, "root", group_shared=True, make=False)
        self._fds.append(fd)
        try:
            self.objects_fd = self._open_dir(fd, "objects")
        except OSError:
            self.close()
            raise StorageError(
                f"{self.root} is not a kvtier file store (no objects/ directory)"
            ) from None

    def __enter__(self) -> StoreTree:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.pop())

    def _open_dir(self, dir_fd: int, name: str) -> int:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)  # never through a link
        self._fds.append(fd)
        return fd

    def scan(self) -> Iterator[StoredObject]:
        """Every entry of the store's object directories, each object's header and key read."""
        top = self.root / "objects"
        for name in sorted(os.listdir(self.objects_fd)):
            fanout = None
            if FANOUT_NAME.fullmatch(name):
                try:
                    fanout = self._open_dir(self.objects_fd, name)
                except OSError as e:
                    if e.errno not in (errno.ENOTDIR, errno.ELOOP, errno.ENOENT):
                        raise
            if fanout is None:
                yield _foreign(self.objects_fd, top / name, "not a fan-out directory of the store")
                continue
            for entry in sorted(os.listdir(fanout)):
                path = top / name / entry
                if TMP_NAME.fullmatch(entry):
                    continue  # a write in progress (or a dead writer's, removed at the next start)
                if not OBJECT_NAME.fullmatch(entry):
                    yield _foreign(fanout, path, "not an object name")
                else:
                    yield inspect(fanout, path)


def scan(root: str | Path) -> list[StoredObject]:
    """Every entry of the store at ``root`` (headers and keys read; nothing to open later)."""
    with StoreTree(root) as tree:
        return list(tree.scan())


def _foreign(dir_fd: int, path: Path, why: str) -> StoredObject:
    try:
        st = os.stat(path.name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        st = None
    size = st.st_size if st and stat.S_ISREG(st.st_mode) else 0
    return StoredObject(
        path, size, st.st_mtime if st else 0.0, problem=why, foreign=True, dir_fd=dir_fd
    )


def _open(dir_fd: int, name: str) -> int | None:
    """A descriptor of the regular file ``name`` in ``dir_fd``; None for anything else (never
    followed)."""
    try:
        fd = os.open(
            name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
        )
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.ENOENT):
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def inspect(dir_fd: int, path: Path) -> StoredObject:
    """The object ``path.name`` in ``dir_fd``: header and key read and checked against each
    other and the file's name and size (the payload is not read: see ``verify_object``)."""
    fd = _open(dir_fd, path.name)
    if fd is None:
        return _foreign(dir_fd, path, "not a regular file")
    try:
        st = os.fstat(fd)
        found = StoredObject(path, st.st_size, st.st_mtime, dir_fd=dir_fd)
        try:
            found.header = read_header(os.pread(fd, HEADER_BYTES, 0))
            h = found.header
            if h.payload_length > MAX_PAYLOAD_BYTES:
                raise ObjectCorrupt(f"header claims a {h.payload_length}-byte payload")
            if st.st_size != HEADER_BYTES + h.payload_length + h.key_bytes:
                raise ObjectCorrupt(f"object is {st.st_size} bytes, its header says otherwise")
            if h.key_bytes:
                found.key = os.pread(fd, h.key_bytes, st.st_size - h.key_bytes).decode()
                _check_key(found, path)
        except (ObjectCorrupt, UnicodeDecodeError) as e:
            found.problem = str(e)
        return found
    finally:
        os.close(fd)


def _check_key(found: StoredObject, path: Path) -> None:
    assert found.key is not None and found.header is not None
    digest = hashlib.sha256(found.key.encode()).digest()
    if path.name != digest.hex() + ".kvb":
        raise ObjectCorrupt("the key trailer does not name this file")
    if found.header.version == PLAIN and found.header.digest != digest[:16]:
        raise ObjectCorrupt("the key trailer does not match the header")
    found.parts = KeyScheme.parse(found.key)
    if found.parts is None:
        raise ObjectCorrupt("the key trailer is not a kvtier storage key")
    if found.parts.fingerprint != found.header.fingerprint:
        raise ObjectCorrupt("the key's fingerprint differs from the header's")


def verify_object(
    found: StoredObject, mac_key: bytes | None = None, buffer: bytearray | None = None
) -> StoredObject:
    """Read the payload and check it (XXH3; the MAC too when the object has one and
    ``mac_key`` is given), ``READ_CHUNK`` bytes at a time into ``buffer``: memory stays bounded
    whatever a header claims. Sets ``found.problem`` when it fails."""
    if found.foreign or found.problem or found.header is None:
        return found
    h = found.header
    fd = _open(found.dir_fd, found.path.name) if found.dir_fd is not None else None
    if fd is None:
        found.problem = "removed or replaced while checking"
        return found
    chunk = memoryview(buffer if buffer is not None else bytearray(READ_CHUNK))
    try:
        raw = os.pread(fd, HEADER_BYTES, 0)
        authenticated = h.version != PLAIN and mac_key is not None
        fmt = ObjectFormat(h.fingerprint, mac_key if authenticated else None)
        if authenticated:
            fmt.parse(raw, found.key or "", h.payload_length)
        mac = fmt.mac_state(raw, found.key or "") if authenticated else None
        checksum = xxhash.xxh3_64()
        done = 0
        while done < h.payload_length:
            n = os.preadv(
                fd, [chunk[: min(len(chunk), h.payload_length - done)]], HEADER_BYTES + done
            )
            if n <= 0:
                raise ObjectCorrupt(f"short read at {done} of {h.payload_length} payload bytes")
            checksum.update(chunk[:n])
            if mac is not None:
                mac.update(chunk[:n])
            done += n
        if mac is not None and not hmac.compare_digest(raw[16:32], mac.digest(length=MAC_BYTES)):
            raise ObjectCorrupt("MAC mismatch: not written by a holder of storage.mac_key_file")
        if checksum.intdigest() != h.checksum:
            raise ObjectCorrupt("payload checksum mismatch")
    except ObjectCorrupt as e:
        found.problem = str(e)
    finally:
        os.close(fd)
    return found


def check_layouts(objects: list[StoredObject]) -> None:
    """One layout (fingerprint) has one payload size: an object whose header claims another
    size than most objects of its layout is marked corrupt before anything reads it."""
    sizes: dict[str, Counter] = defaultdict(Counter)
    for o in objects:
        if o.header is not None and not o.problem:
            sizes[o.fingerprint][o.header.payload_length] += 1
    for o in objects:
        if o.header is None or o.problem or len(sizes[o.fingerprint]) < 2:
            continue
        (common, count), *_ = sizes[o.fingerprint].most_common(1)
        if (
            o.header.payload_length != common
            and sizes[o.fingerprint][o.header.payload_length] < count
        ):
            o.problem = (
                f"header claims a {o.header.payload_length}-byte payload; layout "
                f"{o.fingerprint} has {common}-byte payloads"
            )


def remove(found: StoredObject) -> bool:
    """Unlink one object of the store's layout (never a foreign entry) from the directory it was
    listed in (its ``StoreTree`` still open); False if already gone."""
    if found.foreign or not OBJECT_NAME.fullmatch(found.path.name) or found.dir_fd is None:
        raise StorageError(f"refusing to remove {found.path}: not an object of the store")
    try:
        os.unlink(found.path.name, dir_fd=found.dir_fd)
    except FileNotFoundError:
        return False
    return True


@dataclass(frozen=True)
class Selection:
    """What ``gc`` removes: objects matching every given criterion, then (``capacity_bytes``)
    the least recently used of the rest until the store fits."""

    namespaces: frozenset[str] = frozenset()
    versions: frozenset[str] = frozenset()
    fingerprints: frozenset[str] = frozenset()
    older_than_s: float | None = None
    capacity_bytes: int | None = None

    @property
    def filters(self) -> bool:
        return bool(
            self.namespaces or self.versions or self.fingerprints or self.older_than_s is not None
        )

    def matches(self, found: StoredObject, now: float) -> bool:
        return (
            (not self.namespaces or found.namespace in self.namespaces)
            and (not self.versions or found.version in self.versions)
            and (not self.fingerprints or found.fingerprint in self.fingerprints)
            and (self.older_than_s is None or now - found.mtime > self.older_than_s)
        )


def select(objects: list[StoredObject], selection: Selection) -> list[tuple[StoredObject, str]]:
    """(object, reason) for each object ``selection`` removes; foreign entries never."""
    if not selection.filters and selection.capacity_bytes is None:
        raise StorageError(
            "say what to remove: --namespace, --version, --fingerprint, --older-than or --capacity"
        )
    now = time.time()
    own = [o for o in objects if not o.foreign]
    chosen = [(o, "matches") for o in own if selection.filters and selection.matches(o, now)]
    if selection.capacity_bytes is not None:
        gone = {id(o) for o, _ in chosen}
        rest = sorted((o for o in own if id(o) not in gone), key=lambda o: o.mtime)
        used = sum(o.size for o in rest)
        for found in rest:  # least recently used first, as the store itself evicts
            if used <= selection.capacity_bytes:
                break
            chosen.append((found, "over capacity"))
            used -= found.size
    return chosen


def verify_all(
    objects: list[StoredObject],
    mac_key: bytes | None,
    progress: Callable[[int, int], None] | None = None,
) -> list[StoredObject]:
    """``verify_object`` on each (after ``check_layouts``), reporting (done, total) to
    ``progress``; one read buffer for all."""
    check_layouts(objects)
    buffer = bytearray(READ_CHUNK)
    for i, found in enumerate(objects, 1):
        verify_object(found, mac_key, buffer)
        if progress is not None:
            progress(i, len(objects))
    return objects
