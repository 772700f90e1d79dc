"""The instance secret: who may talk to a worker over TCP, and how both ends prove it.

An ``ipc://`` endpoint lives in a private (0700) directory of the engine's user: the operating
system lets no one else connect. A ``tcp://`` endpoint on loopback is open to every local user
(and a local user may bind the port first, or after a worker crashed), so a worker serving one
requires a secret: a file of this user, mode 0600, holding at least 16 random bytes (hex).

The secret never crosses the wire. Both ends derive two CURVE key pairs from it (keyed BLAKE3
in key-derivation mode): the worker's, which the client pins as the server key, and the
client's, the only one the worker's ZAP handler admits. ZeroMQ's CURVE handshake then proves
each end to the other before a single application frame is exchanged: an impostor on the port
cannot complete it (the client fails its start naming a possible impostor), a stranger without
the secret gets no frame through, and captured bytes are useless (per-connection keys).
"""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

import blake3

from kvtier.errors import ConfigError

MIN_KEY_BYTES = 16
MAX_KEY_FILE_BYTES = 4096


def read_private_file(path: str | Path, field: str, max_bytes: int) -> bytes:
    """At most ``max_bytes`` of ``path``, checked on the descriptor: a regular file (no link
    followed, no FIFO waited on) of this user with no group/other access (a secret)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(field, f"cannot open {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigError(field, f"{path} must be a regular file of this user with mode 0600")
        return os.read(fd, max_bytes)
    finally:
        os.close(fd)


def read_key(path: str | Path, field: str = "auth_key_file") -> bytes:
    """The secret in ``path``: a regular file of this user, no group/other access, hex."""
    raw = read_private_file(path, field, MAX_KEY_FILE_BYTES)
    text = raw.decode("ascii", errors="replace").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ConfigError(field, f"{path} must hold the secret in hex") from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(field, f"{path} holds {len(key)} bytes; at least {MIN_KEY_BYTES}")
    return key


def write_key(path: str | Path) -> bytes:
    """A new secret in a new 0600 file at ``path``; returns it."""
    key = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, key.hex().encode() + b"\n")
    finally:
        os.close(fd)
    return key


_SERVER_CONTEXT = "kvtier 2026-12 CURVE worker key"
_CLIENT_CONTEXT = "kvtier 2026-12 CURVE client key"


@dataclass(frozen=True)
class CurveKeys:
    """The CURVE key pairs of one instance secret (Z85 text, as ZeroMQ takes them)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> CurveKeys:
        import zmq

        if not zmq.has("curve"):
            raise ConfigError("auth_key_file", "this libzmq has no CURVE support")
        server = _z85(blake3.blake3(secret, derive_key_context=_SERVER_CONTEXT).digest())
        client = _z85(blake3.blake3(secret, derive_key_context=_CLIENT_CONTEXT).digest())
        return cls(zmq.curve_public(server), server, zmq.curve_public(client), client)

    @classmethod
    def from_file(cls, path: str | Path, field: str = "auth_key_file") -> CurveKeys:
        return cls.from_secret(read_key(path, field))

    def __repr__(self) -> str:  # never print secret keys
        return f"CurveKeys(server={self.server_public.decode()})"


def _z85(key: bytes) -> bytes:
    from zmq.utils import z85

    return z85.encode(key)
