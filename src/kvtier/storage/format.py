"""The stored object: a 64-byte self-checking header followed by one page-first host block.

Header layout (little-endian)::

    offset size  field
         0    4  magic b"KVTB"
         4    2  format version (1)
         6    2  reserved, must be 0
         8    8  layout fingerprint (KVCacheSpec.fingerprint, 16 hex digits as 8 bytes)
        16   16  first 16 bytes of sha256(storage key): an object under the wrong name is caught
        32    8  payload length in bytes
        40    8  XXH3-64 of the payload
        48    8  reserved, must be 0
        56    8  XXH3-64 of header bytes 0..55

Every field is checked on read and the header checks itself, so a flipped bit anywhere in the
object (header or payload) is detected; a detected object is a miss, never data.
"""

from __future__ import annotations

import hashlib
import struct

import xxhash

from kvtier.checksum import payload_checksum
from kvtier.errors import ObjectCorrupt

MAGIC = b"KVTB"
FORMAT_VERSION = 1
HEADER_BYTES = 64
_BODY = struct.Struct("<4sHH8s16sQQ8x")  # 56 bytes
_CHECK = struct.Struct("<Q")


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()[:16]


def encode_header(fingerprint: str, key: str, payload_length: int, checksum: int) -> bytes:
    body = _BODY.pack(
        MAGIC,
        FORMAT_VERSION,
        0,
        bytes.fromhex(fingerprint),
        key_digest(key),
        payload_length,
        checksum,
    )
    return body + _CHECK.pack(xxhash.xxh3_64_intdigest(body))


def parse_header(header, fingerprint: str, key: str, payload_length: int) -> int:
    """Check every header field against what the reader expects; return the payload checksum.

    Raises ObjectCorrupt naming the first field that does not match.
    """
    raw = bytes(header[:HEADER_BYTES])
    if len(raw) < HEADER_BYTES:
        raise ObjectCorrupt(f"header truncated to {len(raw)} bytes")
    (self_check,) = _CHECK.unpack_from(raw, _BODY.size)
    if xxhash.xxh3_64_intdigest(raw[: _BODY.size]) != self_check:
        raise ObjectCorrupt("header checksum mismatch")
    magic, version, reserved, fp, digest, length, checksum = _BODY.unpack_from(raw)
    if magic != MAGIC:
        raise ObjectCorrupt(f"bad magic {magic!r}")
    if version != FORMAT_VERSION or reserved != 0:
        raise ObjectCorrupt(f"unknown format version {version}")
    if fp.hex() != fingerprint:
        raise ObjectCorrupt(f"layout fingerprint {fp.hex()} != {fingerprint}")
    if digest != key_digest(key):
        raise ObjectCorrupt("object stored under another key")
    if length != payload_length:
        raise ObjectCorrupt(f"payload length {length} != {payload_length}")
    return checksum


def check_object(header, payload, fingerprint: str, key: str) -> None:
    """Raise ObjectCorrupt unless header and payload are exactly what was stored under ``key``."""
    expected = parse_header(header, fingerprint, key, len(payload))
    if payload_checksum(payload) != expected:
        raise ObjectCorrupt("payload checksum mismatch")


def check_scattered(header, views, fingerprint: str, key: str, payload_length: int) -> None:
    """``check_object`` for a payload scattered over several buffers, in order."""
    expected = parse_header(header, fingerprint, key, payload_length)
    state = xxhash.xxh3_64()
    for view in views:
        state.update(view)
    if state.intdigest() != expected:
        raise ObjectCorrupt("payload checksum mismatch")


def check_or_defer(header, payload, fingerprint: str, key: str, checksums_out, index: int) -> None:
    """``check_object``; or, when ``checksums_out`` is given, check the header only and write
    its payload checksum to ``checksums_out[index]`` for the caller to verify the bytes later."""
    if checksums_out is None:
        check_object(header, payload, fingerprint, key)
    else:
        checksums_out[index] = parse_header(header, fingerprint, key, len(payload))
