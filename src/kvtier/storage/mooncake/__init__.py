"""The Mooncake backend: ``store`` over Mooncake Store's client; ``config`` its options and the
process environment it needs; ``local`` a master and store node this machine runs itself."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtier.storage.mooncake.config import MooncakeConfig

if TYPE_CHECKING:
    from kvtier.layout.spec import KVCacheSpec
    from kvtier.storage.base import StorageBackend


def parse_options(data: Mapping[str, Any]) -> MooncakeConfig:
    return MooncakeConfig.from_dict(data)


def open_backend(
    spec: KVCacheSpec, options: MooncakeConfig, mac_key: bytes | None
) -> StorageBackend:
    from kvtier.storage.mooncake.store import MooncakeStore

    return MooncakeStore(spec, options, mac_key=mac_key)
