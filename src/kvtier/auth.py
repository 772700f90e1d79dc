"""The instance secret: who may talk to a worker over TCP.

An ``ipc://`` endpoint lives in a private (0700) directory of the engine's user: the operating
system lets no one else connect. A ``tcp://`` endpoint on loopback is open to every local user,
so a worker serving one requires a secret: a file of this user, mode 0600, holding at least 16
random bytes (hex). A client proves it knows the secret in its hello; a peer that does not gets
every task refused and keeps nothing alive. ``Client.launch`` makes one per launch.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

from kvtier.errors import ConfigError

MIN_KEY_BYTES = 16
MAX_KEY_FILE_BYTES = 4096


def read_key(path: str | Path, field: str = "auth_key_file") -> bytes:
    """The secret in ``path``: a regular file of this user, no group/other access, hex."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(field, f"cannot open {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigError(field, f"{path} must be a regular file of this user with mode 0600")
        text = os.read(fd, MAX_KEY_FILE_BYTES).decode("ascii", errors="replace").strip()
    finally:
        os.close(fd)
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


def matches(expected: bytes | None, offered: bytes) -> bool:
    """Constant-time; no secret configured accepts any hello (ipc:// in a private directory)."""
    return expected is None or hmac.compare_digest(expected, offered)
