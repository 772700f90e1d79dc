"""The stored object: a 64-byte self-checking header followed by one page-first host block.

Header layout (little-endian)::

    offset size  field
         0    4  magic b"KVTB"
         4    2  format version: 1 plain, 2 authenticated (see below)
         6    2  reserved, must be 0
         8    8  layout fingerprint (KVCacheSpec.fingerprint, 16 hex digits as 8 bytes)
        16   16  v1: first 16 bytes of sha256(storage key): an object under the wrong name is caught
                 v2: MAC (see below)
        32    8  payload length in bytes
        40    8  XXH3-64 of the payload
        48    2  key trailer length: the storage key (UTF-8) follows the payload (file store;
                 0: no trailer). Lets tools tell namespace, version and rank of an object.
        50    6  reserved, must be 0
        56    8  XXH3-64 of header bytes 0..55

Every field is checked on read and the header checks itself, so a flipped bit anywhere in the
object (header or payload) is detected; a detected object is a miss, never data.

Authenticated objects (``storage.mac_key_file``). Checksums catch accidents, not a writer of the
store (or any Mooncake client) forging an object for a predictable key. With a MAC key every
object is written as version 2, whose bytes 16..31 hold a 128-bit keyed BLAKE3 of header bytes
0..15 || header bytes 32..55 || len(storage key) || storage key || payload. (Keyed BLAKE3 is a
MAC by design and runs at 2.5-3.5 GB/s per core here, 2.5x HMAC-SHA256 even with SHA-NI; the
32-byte BLAKE3 key is derived from the configured secret with BLAKE3's key derivation mode.)
A reader with a key accepts only version-2 objects whose MAC it recomputes over the bytes it
read; an unauthenticated (version 1) object, one under another key, or one made with another
MAC key is corrupt: a miss, removed. A reader without a key refuses version-2 objects the same
way, so a store is either authenticated or not — configure every writer alike. A memory store
reading an object its own put wrote into its private memory skips the MAC (``check``'s ``mac``):
its authorship is known, and the checksum still covers the bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import NamedTuple

import blake3
import xxhash

from kvtier.errors import ObjectCorrupt
from kvtier.layout.checksum import payload_checksum

MAGIC = b"KVTB"
PLAIN, AUTHENTICATED = 1, 2
HEADER_BYTES = 64
MAC_BYTES = 16
_BODY = struct.Struct("<4sHH8s16sQQH6x")  # 56 bytes
_CHECK = struct.Struct("<Q")
_KEY_LENGTH = struct.Struct("<Q")
_KDF_CONTEXT = "kvtier 2026-11 storage object MAC v2"


class Header(NamedTuple):
    version: int
    fingerprint: str  # 16 hex digits
    digest: bytes  # v1: sha256(key)[:16]; v2: the MAC
    payload_length: int
    checksum: int  # XXH3-64 of the payload
    key_bytes: int  # length of the key trailer (0: none)


def read_header(header) -> Header:
    """The fields of a header that checks itself (checksum, magic, known version), with no
    expectations about them (inspection tools). Raises ObjectCorrupt."""
    raw = bytes(header[:HEADER_BYTES])
    if len(raw) < HEADER_BYTES:
        raise ObjectCorrupt(f"header truncated to {len(raw)} bytes")
    (self_check,) = _CHECK.unpack_from(raw, _BODY.size)
    if xxhash.xxh3_64_intdigest(raw[: _BODY.size]) != self_check:
        raise ObjectCorrupt("header checksum mismatch")
    magic, version, reserved, fp, digest, length, checksum, key_bytes = _BODY.unpack_from(raw)
    if magic != MAGIC:
        raise ObjectCorrupt(f"bad magic {magic!r}")
    if version not in (PLAIN, AUTHENTICATED) or reserved != 0:
        raise ObjectCorrupt(f"unknown format version {version}")
    return Header(version, fp.hex(), digest, length, checksum, key_bytes)


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()[:16]


def checksum_of(views: Sequence) -> int:
    """XXH3-64 of a payload held in one buffer or scattered over several, in order."""
    if len(views) == 1:
        return payload_checksum(views[0])
    state = xxhash.xxh3_64()
    for view in views:
        state.update(view)
    return state.intdigest()


class ObjectFormat:
    """Encodes and checks the objects of one layout (``fingerprint``), keyed by ``mac_key``.

    Thread-safe (no state beyond the constructor's arguments).
    """

    def __init__(self, fingerprint: str, mac_key: bytes | None = None) -> None:
        self.fingerprint = fingerprint
        self.mac_key = mac_key
        self._blake3_key = (
            None
            if mac_key is None
            else blake3.blake3(mac_key, derive_key_context=_KDF_CONTEXT).digest()
        )
        self.version = PLAIN if mac_key is None else AUTHENTICATED

    @property
    def authenticated(self) -> bool:
        return self.mac_key is not None

    # ---- writing ----------------------------------------------------------------------------

    def header(
        self, key: str, payload: Sequence, checksum: int | None = None, *, trailer: bool = False
    ) -> bytes:
        """The header for ``payload`` (a list of buffers) stored under ``key``.

        ``checksum``: the payload's XXH3-64 when the caller knows it (recorded by the copier).
        ``trailer``: the object ends with the key (its length recorded here).
        """
        length = sum(memoryview(v).nbytes for v in payload)
        if checksum is None:
            checksum = checksum_of(payload)
        key_bytes = len(key.encode()) if trailer else 0
        fields = [MAGIC, self.version, 0, bytes.fromhex(self.fingerprint), b"", length, checksum]
        fields.append(key_bytes)
        if self.mac_key is None:
            fields[4] = key_digest(key)
        else:
            fields[4] = self._mac(_BODY.pack(*fields[:4], bytes(16), *fields[5:]), key, payload)
        body = _BODY.pack(*fields)
        return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))

    def _mac(self, body: bytes, key: str, payload: Sequence) -> bytes:
        state = self.mac_state(body, key)
        for view in payload:
            state.update(view)
        return state.digest(length=MAC_BYTES)

    def mac_state(self, header, key: str):
        """A BLAKE3 state over the MAC's header and key parts: feed it the payload, in order,
        then compare ``state.digest(length=MAC_BYTES)`` with header bytes 16..31 (a payload
        checked in pieces, never held whole)."""
        assert self._blake3_key is not None
        body = bytes(header[:56])
        state = blake3.blake3(key=self._blake3_key)
        state.update(body[:16])
        state.update(body[32:56])
        encoded = key.encode()
        state.update(_KEY_LENGTH.pack(len(encoded)))
        state.update(encoded)
        return state

    # ---- reading ----------------------------------------------------------------------------

    def parse(self, header, key: str, payload_length: int) -> Header:
        """Check every header field against what the reader expects; return them.

        Raises ObjectCorrupt naming the first field that does not match. (The MAC of an
        authenticated object covers the payload: ``check`` verifies it.)
        """
        fields = read_header(header)
        version, fp, digest, length = fields[:4]
        if version != self.version:
            raise ObjectCorrupt(
                "object is not authenticated (written without storage.mac_key_file)"
                if version == PLAIN
                else "object is authenticated but this reader has no storage.mac_key_file"
            )
        if fp != self.fingerprint:
            raise ObjectCorrupt(f"layout fingerprint {fp} != {self.fingerprint}")
        if version == PLAIN and digest != key_digest(key):
            raise ObjectCorrupt("object stored under another key")
        if length != payload_length:
            raise ObjectCorrupt(f"payload length {length} != {payload_length}")
        if fields.key_bytes not in (0, len(key.encode())):
            raise ObjectCorrupt(f"key trailer of {fields.key_bytes} bytes does not fit the key")
        return fields

    def check(
        self,
        header,
        payload: Sequence,
        key: str,
        payload_length: int,
        payload_hash: int | None = None,
        fields: Header | None = None,
        mac: bool = True,
    ) -> None:
        """Raise ObjectCorrupt unless header and payload (a list of buffers, in order) are
        exactly what was stored under ``key``. ``payload_hash``: the payload's XXH3-64 when the
        reader computed it as the bytes arrived (``file_io.read_object``); ``fields``: what
        ``parse`` returned for this header, if the caller already parsed it. ``mac=False``: the
        object was written by this process into memory no one else can write (a memory tier's
        own puts), so its authorship is known; the checksum still covers the payload."""
        if fields is None:
            fields = self.parse(header, key, payload_length)
        expected = fields.checksum
        if self.mac_key is not None and mac:
            self._check_mac(header, key, payload)
        if payload_hash is None:
            payload_hash = checksum_of(payload)
        if payload_hash != expected:
            raise ObjectCorrupt("payload checksum mismatch")

    def _check_mac(self, header, key: str, payload: Sequence) -> None:
        raw = bytes(header[:HEADER_BYTES])
        if not hmac.compare_digest(raw[16:32], self._mac(raw, key, payload)):
            raise ObjectCorrupt("MAC mismatch: not written by a holder of storage.mac_key_file")

    def check_or_defer(
        self,
        header,
        payload,
        key: str,
        checksums_out,
        index: int,
        payload_hash: int | None = None,
        fields: Header | None = None,
        mac: bool = True,
        headers_out: list[bytes | None] | None = None,
    ) -> None:
        """``check`` of a one-buffer payload; or, when ``checksums_out`` is given, the header
        only (and the MAC) with the payload checksum written to ``checksums_out[index]`` for
        the caller to verify the bytes later. ``mac``: as for ``check``. ``headers_out`` (with
        ``checksums_out``): the MAC is the caller's too — a private copy of the header, the one
        checked here, goes to ``headers_out[index]`` for ``check_deferred`` on bytes no peer of
        the store can write. (A backend's ``ReadResult.checksums`` and ``.headers``: None
        unless the ``Read`` leaves the check to its caller, ``kvtier.storage.base.Verify``.)"""
        if headers_out is not None:
            raw = bytes(header[:HEADER_BYTES])  # the header may sit in memory a peer can write
            checksums_out[index] = self.parse(raw, key, len(payload)).checksum
            headers_out[index] = raw
            return
        if fields is None:
            fields = self.parse(header, key, len(payload))
        if checksums_out is None:
            self.check(header, [payload], key, len(payload), payload_hash, fields, mac)
            return
        checksums_out[index] = fields.checksum
        if self.mac_key is not None and mac:
            self._check_mac(header, key, [payload])

    def check_deferred(self, header: bytes, key: str, payload: Sequence) -> None:
        """The payload check a ``Read`` with ``Verify.ALL_BY_CALLER`` left to its caller, over the
        bytes where they now lie (a list of buffers, in order; memory no peer of the store can
        write): the MAC where objects are authenticated (it covers the checksum field too),
        the checksum otherwise. ``header``: the private copy from ``ReadResult.headers``. Raises
        ObjectCorrupt."""
        if self.mac_key is not None:
            self._check_mac(header, key, payload)
        elif checksum_of(payload) != read_header(header).checksum:
            raise ObjectCorrupt("payload checksum mismatch")
