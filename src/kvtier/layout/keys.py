"""Block keys: chained SHA-256 block hashes, the storage key scheme, and the weight version.

Hash encoding (version 1), for each *full* block of ``block_size`` tokens::

    sha256( b"kvtier-block-v1\\0"
            + parent            # 32 bytes: the previous block's hash, or 32 zero bytes
            + u32le(block_size)
            + token ids         # block_size x int64, little-endian
            + u32le(len(extra)) + for each extra key: u32le(len(item)) + item bytes )

Extra keys are per block (multimodal item hashes, a LoRA name, a cache salt): ``str`` items are
UTF-8 encoded, ``bytes`` taken as they are. A trailing partial block has no hash. Hashes are the
full 32 bytes and are never truncated.

Engines that hash blocks themselves (vLLM: sha256 -> 32 bytes, xxhash -> 16) pass their hashes
as they are: a storage key accepts any hash of ``MIN_HASH_BYTES``..``MAX_HASH_BYTES`` bytes. The
hash algorithm then belongs in the namespace, so hashes of two algorithms never share keys.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
import struct
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import NamedTuple

import numpy as np
import yaml

from kvtier.errors import ConfigError, InvalidBlockHash, InvalidInput

log = logging.getLogger(__name__)

HASH_BYTES = 32
MIN_HASH_BYTES = 16
MAX_HASH_BYTES = 64
MAX_FIELD_CHARS = 128  # namespace, version: bounded so that keys stay small
VERSION_FILE_MAX_BYTES = 4096
ROOT_PARENT = bytes(HASH_BYTES)
_DOMAIN = b"kvtier-block-v1\0"
KEY_SCHEME = "kv1"
# Keys a KeyScheme keeps built (~200 bytes each with its hash: ~6 MiB): 32k blocks, half a
# million tokens of prefixes at 16 tokens a block.
KEY_CACHE_ENTRIES = 1 << 15
VERSION_FILE = "version.yaml"
_VERSION_RE = re.compile(r"^(RL-STEP\d+)(?:-|$)")
_warned_version_paths: set[str] = set()

ExtraKey = bytes | str


class KeyParts(NamedTuple):
    """A storage key's fields (``KeyScheme.parse``)."""

    namespace: str
    version: str
    fingerprint: str
    block_hash: str  # hex
    rank: int


def block_hashes(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    parent: bytes | None = None,
    extra: Sequence[Sequence[ExtraKey]] = (),
) -> list[bytes]:
    """One chained SHA-256 per full block of ``token_ids``.

    ``parent`` is the hash of the block before ``token_ids[0]`` (None at the start of a
    sequence). ``extra``, when given, holds one sequence of extra keys per full block.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise InvalidInput(f"block_size must be a positive integer, got {block_size!r}")
    if parent is None:
        parent = ROOT_PARENT
    if len(parent) != HASH_BYTES:
        raise InvalidBlockHash(f"parent must be a {HASH_BYTES}-byte block hash, got {len(parent)}")
    tokens = np.asarray(token_ids)
    if tokens.size and (tokens.ndim != 1 or tokens.dtype.kind not in "iu"):
        raise InvalidInput("token_ids must be a flat sequence of integers")
    encoded = tokens.astype("<i8", copy=False).tobytes()
    num_full = tokens.size // block_size
    if extra and len(extra) != num_full:
        raise InvalidInput(f"extra: need one entry per full block ({num_full}), got {len(extra)}")
    step = block_size * 8
    size_field = struct.pack("<I", block_size)
    hashes = []
    for i in range(num_full):
        h = hashlib.sha256(_DOMAIN)
        h.update(parent)
        h.update(size_field)
        h.update(encoded[i * step : (i + 1) * step])
        items = extra[i] if extra else ()
        h.update(struct.pack("<I", len(items)))
        for item in items:
            raw = item.encode() if isinstance(item, str) else bytes(item)
            h.update(struct.pack("<I", len(raw)))
            h.update(raw)
        parent = h.digest()
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class KeyScheme:
    """Everything in a storage key except the block hash: one place builds every key.

    ``namespace`` names the model (any text without ':' or whitespace), ``version`` the weights
    (empty until one is known), ``fingerprint`` the layout (KVCacheSpec.fingerprint), ``rank``
    the tensor-parallel rank whose shard the object holds.
    """

    namespace: str
    fingerprint: str
    rank: int = 0
    version: str = ""
    # Keys built lately, by block hash (bounded by KEY_CACHE_ENTRIES; emptied when full): an
    # engine asks for the same prefixes step after step, and a cached key costs a dict lookup
    # instead of a hex encoding and two concatenations. Only checked hashes are put in.
    _cache: dict[bytes, str] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        for name in ("namespace", "version", "fingerprint"):
            value = getattr(self, name)
            if (
                not isinstance(value, str)
                or re.search(r"[:\s]", value)
                or len(value) > MAX_FIELD_CHARS
            ):
                shown = value[:40] if isinstance(value, str) else value
                raise ConfigError(
                    name,
                    f"must be text of at most {MAX_FIELD_CHARS} characters without ':' or "
                    f"whitespace, got {shown!r}",
                )
        if not self.namespace:
            raise ConfigError("namespace", "must not be empty (use the model id)")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ConfigError("rank", f"must be an integer >= 0, got {self.rank!r}")

    def key(self, block_hash: bytes) -> str:
        """``kv1:{namespace}:{version}:{fingerprint}:{hash hex}:{rank}``."""
        check_block_hash(block_hash)
        head, tail = self._around_hash
        return head + block_hash.hex() + tail

    @cached_property
    def _around_hash(self) -> tuple[str, str]:
        """What a key holds before and after the block hash (the same for every block)."""
        return f"{KEY_SCHEME}:{self.namespace}:{self.version}:{self.fingerprint}:", f":{self.rank}"

    @staticmethod
    def parse(key: str) -> KeyParts | None:
        """The fields of a storage key ``key`` built, or None for any other string."""
        fields = key.split(":")
        if len(fields) != 6 or fields[0] != KEY_SCHEME or not fields[5].isdigit():
            return None
        return KeyParts(fields[1], fields[2], fields[3], fields[4], int(fields[5]))

    def keys(self, block_hashes: Sequence[bytes]) -> list[str]:
        cache = self._cache
        try:  # every hash seen lately (so checked then): C-speed
            return list(map(cache.__getitem__, block_hashes))
        except (KeyError, TypeError):  # one not seen, or not hashable (not bytes)
            pass
        check_block_hashes(block_hashes)
        head, tail = self._around_hash
        keys = [head + h.hex() + tail for h in block_hashes]
        if len(cache) + len(keys) > KEY_CACHE_ENTRIES:
            cache.clear()
        if len(keys) <= KEY_CACHE_ENTRIES:
            cache.update(zip(block_hashes, keys))
        return keys

    def with_version(self, version: str) -> KeyScheme:
        return KeyScheme(self.namespace, self.fingerprint, self.rank, version)


def check_block_hashes(block_hashes: Sequence[object]) -> None:
    """InvalidBlockHash naming the first hash of ``block_hashes`` that is not bytes of an
    accepted length (C-speed when all are: a lookup carries thousands)."""
    if set(map(type, block_hashes)) <= {bytes}:
        lengths = set(map(len, typing.cast("Sequence[bytes]", block_hashes)))
        if not lengths or MIN_HASH_BYTES <= min(lengths) <= max(lengths) <= MAX_HASH_BYTES:
            return
    for i, h in enumerate(block_hashes):  # the slow way, to name the first bad one
        check_block_hash(h, i)


def check_block_hash(block_hash: object, index: int | None = None) -> None:
    """InvalidBlockHash unless ``block_hash`` is bytes of an accepted length."""
    if type(block_hash) is bytes and MIN_HASH_BYTES <= len(block_hash) <= MAX_HASH_BYTES:
        return
    where = "block hash" if index is None else f"block hash {index}"
    if not isinstance(block_hash, bytes):
        raise InvalidBlockHash(f"{where} must be bytes, got {type(block_hash).__name__}")
    if not MIN_HASH_BYTES <= len(block_hash) <= MAX_HASH_BYTES:
        raise InvalidBlockHash(
            f"{where} has {len(block_hash)} bytes, need {MIN_HASH_BYTES}..{MAX_HASH_BYTES}"
        )


def _read_small_file(path: Path, limit: int) -> str:
    """At most ``limit`` bytes of a regular file; never blocks (a FIFO is refused)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{st.st_size} bytes, more than {limit}")
        return os.read(fd, limit).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


def read_weight_version(model_dir: str | Path | None) -> str:
    """The weight version from ``<model_dir>/version.yaml`` (``RL-STEP{n}-...`` -> ``RL-STEP{n}``).

    A missing or malformed file gives ``""`` and one warning per file.
    """
    if model_dir is None:
        return ""
    path = Path(model_dir) / VERSION_FILE
    try:
        data = yaml.safe_load(_read_small_file(path, VERSION_FILE_MAX_BYTES))
        value = data.get("version") if isinstance(data, dict) else None
        if not isinstance(value, (str, int)):
            raise ValueError("no 'version: RL-STEP<n>-...' line")
        text = str(value).strip()
        match = _VERSION_RE.match(text)
        if not match:
            raise ValueError(f"version {text[:40]!r} is not RL-STEP<n>-<timestamp>-<uuid>")
        return match.group(1)
    except FileNotFoundError:
        problem = "missing"
    except (OSError, yaml.YAMLError, ValueError) as e:
        problem = f"malformed ({str(e)[:200]})"
    if str(path) not in _warned_version_paths:
        _warned_version_paths.add(str(path))
        log.warning("weight version file %s is %s: using an empty version", path, problem)
    return ""
