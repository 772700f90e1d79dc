"""Storage tier: backends behind one contract, and the factory that builds them from config."""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvtier.errors import ConfigError
from kvtier.storage.config import (
    MAC_KEY_FILE,
    BackendConfig,
    ChainConfig,
    StorageConfig,
    describe,
    in_tier,
    mooncake_config,
    parse_storage,
    register_backend,
)
from kvtier.transport import auth

if TYPE_CHECKING:
    from kvtier.layout.spec import KVCacheSpec
    from kvtier.storage.base import (
        Promotes,
        Read,
        ReadResult,
        ScatteredIO,
        StorageBackend,
        StorageStats,
        StorageUsage,
        Verify,
    )
    from kvtier.storage.object_store import ObjectStore

__all__ = [
    "BackendConfig",
    "ChainConfig",
    "ObjectStore",
    "Promotes",
    "Read",
    "ReadResult",
    "ScatteredIO",
    "StorageBackend",
    "StorageConfig",
    "StorageStats",
    "StorageUsage",
    "Verify",
    "describe_backend",
    "read_mac_key",
    "make_backend",
    "mooncake_config",
    "parse_storage",
    "register_backend",
    "with_memory_tier",
]
# What code outside kvtier.storage may use, by the module that holds it (loaded on first use:
# `kvtier store` needs neither the backends nor torch). Outside this package only
# ``kvtier.storage``, ``kvtier.storage.base`` and ``kvtier.storage.config`` are imported
# (tests/unit/test_structure.py): a backend's modules are its own to reshape.
_LAZY = {
    "StorageBackend": "kvtier.storage.base",
    "Read": "kvtier.storage.base",
    "ReadResult": "kvtier.storage.base",
    "Verify": "kvtier.storage.base",
    "ScatteredIO": "kvtier.storage.base",
    "Promotes": "kvtier.storage.base",
    "ObjectStore": "kvtier.storage.object_store",
    "StorageStats": "kvtier.storage.base",
    "StorageUsage": "kvtier.storage.base",
    "HEADER_BYTES": "kvtier.storage.format",
    "ObjectFormat": "kvtier.storage.format",
    "read_header": "kvtier.storage.format",
    "process_environment": "kvtier.storage.mooncake.config",
    "remove_matching": "kvtier.storage.mooncake.config",
    "LocalMaster": "kvtier.storage.mooncake.local",
    "LocalStoreNode": "kvtier.storage.mooncake.local",
    "LocalS3Server": "kvtier.storage.s3.local",
}
# Operator tools over one backend's stored objects, as modules: ``kvtier store`` on a file store.
_TOOLS = {"file_admin": "kvtier.storage.file.admin", "s3_admin": "kvtier.storage.s3.admin"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _TOOLS:
        return importlib.import_module(_TOOLS[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Every backend takes a MAC key (see kvtier.storage.format, "Authenticated objects").
MAC_KEY_ENV = "KVTIER_STORAGE_MAC_KEY"


def describe_backend(config: Mapping[str, Any] | StorageConfig | None) -> str:
    """``file``, or a chain's backends fastest first: ``memory+file``."""
    return describe(parse_storage(config))


def with_memory_tier(config: Mapping[str, Any], capacity_bytes: int) -> dict[str, Any]:
    """The mapping ``config`` with a memory tier of ``capacity_bytes`` in front of its backend
    (or of its chain's first tier), written through. (Mappings: what a flag adds travels on to
    workers and engines as the user would have written it.)"""
    chain = dict(config) if "tiers" in config else {"tiers": [dict(config)]}
    if MAC_KEY_FILE in chain["tiers"][0]:
        chain[MAC_KEY_FILE] = chain["tiers"][0].pop(MAC_KEY_FILE)
    first = chain["tiers"][0]
    if isinstance(first, Mapping) and first.get("backend") == "memory":
        raise ConfigError("memory_tier", "the storage already starts with a memory tier")
    chain["tiers"] = [{"backend": "memory", "capacity_bytes": capacity_bytes}, *chain["tiers"]]
    return chain


def make_backend(
    spec: KVCacheSpec, config: Mapping[str, Any] | StorageConfig | None = None
) -> StorageBackend:
    """Build a backend from ``{"backend": "file" | "mooncake" | "memory", ...options}``, or a
    tier chain from ``{"tiers": [backend mappings, fastest first], "write": "through" | "back"}``
    (or from their parsed form, ``parse_storage``).

    A ``faults`` mapping in the config wraps the backend in a FaultInjectingStore;
    ``mac_key_file`` (or ``$KVTIER_STORAGE_MAC_KEY``, hex) makes every object authenticated.
    """
    parsed = parse_storage(config)
    mac_key = read_mac_key(parsed.mac_key_file)
    if isinstance(parsed, BackendConfig):
        return _open(parsed, spec, mac_key)
    from kvtier.storage.chain.store import TieredStore

    built: list[StorageBackend] = []
    try:
        for i, tier in enumerate(parsed.tiers):
            built.append(in_tier(i, _open, tier, spec, mac_key))
        return TieredStore(
            built,
            mac_key=mac_key,
            write=parsed.write,
            pending_bytes=parsed.pending_bytes,
            flush_timeout_s=parsed.flush_timeout_s,
        )
    except BaseException:
        for backend in built:
            backend.close()
        raise


def _open(config: BackendConfig, spec: KVCacheSpec, mac_key: bytes | None) -> StorageBackend:
    backend = config.open(spec, mac_key)
    if config.faults is not None:
        from kvtier.storage.wrappers.faults import FaultInjectingStore

        backend = FaultInjectingStore(backend, config.faults)
    return backend


def read_mac_key(path: str | None) -> bytes | None:
    """The MAC key: from ``path`` (a 0600 file of this user, hex), else from the environment."""

    field = f"storage.{MAC_KEY_FILE}"
    if path is not None:
        return auth.read_key(path, field)
    text = os.environ.get(MAC_KEY_ENV)
    if not text:
        return None
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise ConfigError(MAC_KEY_ENV, "must hold the MAC key in hex") from None
    if len(key) < auth.MIN_KEY_BYTES:
        raise ConfigError(MAC_KEY_ENV, f"holds {len(key)} bytes; at least {auth.MIN_KEY_BYTES}")
    return key
