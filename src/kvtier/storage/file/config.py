"""FileStoreConfig: the file backend's options, validated; errors name ``storage.<field>``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from kvtier.common.config_sources import positive, refuse_unknown
from kvtier.errors import ConfigError

# The default store (no root given) is bounded: a user who never configured storage must not find
# the home directory's disk filled by KV. A store at a chosen root is bounded only if asked.
DEFAULT_STORE_CAPACITY_BYTES = 32 << 30


def default_root() -> Path:
    """``$XDG_CACHE_HOME/kvtier/store`` (``~/.cache/kvtier/store``): the XDG convention."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "kvtier" / "store"


class FsyncPolicy(str, Enum):
    NONE = "none"
    DATA = "data"
    FULL = "full"


class Permissions(str, Enum):
    """Who may read the store: ``private`` (0600 objects, 0700 directories: the default — KV is
    a copy of users' prompts) or ``group`` (0660 / 2770, for a store shared between accounts of
    one group)."""

    PRIVATE = "private"
    GROUP = "group"

    @property
    def file_mode(self) -> int:
        return 0o600 if self is Permissions.PRIVATE else 0o660

    @property
    def dir_mode(self) -> int:
        return 0o700 if self is Permissions.PRIVATE else 0o2770


@dataclass(frozen=True)
class FileStoreConfig:
    root: Path
    capacity_bytes: int | None = None
    fsync: FsyncPolicy = FsyncPolicy.NONE
    io_threads: int = 4
    permissions: Permissions = Permissions.PRIVATE

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FileStoreConfig:
        allowed = {"backend", "root", "capacity_bytes", "fsync", "io_threads", "permissions"}
        refuse_unknown(data, allowed, "storage.", "option for the file backend")
        capacity = data.get("capacity_bytes")
        if capacity is not None:
            positive("storage.capacity_bytes", capacity, integer=True)
        try:
            fsync = FsyncPolicy(data.get("fsync", "none"))
        except ValueError:
            raise ConfigError(
                "storage.fsync", f"got {data['fsync']!r}; allowed: none, data, full"
            ) from None
        threads = data.get("io_threads", 4)
        if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= 64:
            raise ConfigError("storage.io_threads", f"must be an integer 1..64, got {threads!r}")
        try:
            permissions = Permissions(data.get("permissions", "private"))
        except ValueError:
            raise ConfigError(
                "storage.permissions", f"got {data['permissions']!r}; allowed: private, group"
            ) from None
        if not data.get("root") and "capacity_bytes" not in data:
            capacity = DEFAULT_STORE_CAPACITY_BYTES
        root = Path(data.get("root") or default_root()).expanduser()
        return cls(root, capacity, fsync, threads, permissions)
