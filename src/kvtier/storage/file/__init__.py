"""The file backend: one checksummed object per block under a directory tree on local disk.

``store`` the backend, ``config`` its options, ``dirs`` the directory tree it trusts, ``objects``
one object's files, ``index`` the recency order that eviction follows, ``io`` the reads and writes
(the C extension and its Python fallback), ``admin`` what ``kvtier store`` does with a store it
does not run. Importing this package loads nothing heavy: the config parses without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtier.storage.file.config import FileStoreConfig

if TYPE_CHECKING:
    from kvtier.layout.spec import KVCacheSpec
    from kvtier.storage.base import StorageBackend


def parse_options(data: Mapping[str, Any]) -> FileStoreConfig:
    return FileStoreConfig.from_dict(data)


def open_backend(
    spec: KVCacheSpec, options: FileStoreConfig, mac_key: bytes | None
) -> StorageBackend:
    from kvtier.storage.file.store import FileStore

    return FileStore(spec, options, mac_key=mac_key)
