"""The s3 backend: one object per block in an S3 bucket (``store``), through obstore
(``client``); ``config`` its options and credentials. Light to import: obstore loads when a
store opens."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtier.storage.s3.config import S3Config

if TYPE_CHECKING:
    from kvtier.layout.spec import KVCacheSpec
    from kvtier.storage.base import StorageBackend


def parse_options(data: Mapping[str, Any]) -> S3Config:
    return S3Config.from_dict(data)


def open_backend(spec: KVCacheSpec, options: S3Config, mac_key: bytes | None) -> StorageBackend:
    from kvtier.storage.s3.store import S3Store

    return S3Store(spec, options, mac_key=mac_key)
