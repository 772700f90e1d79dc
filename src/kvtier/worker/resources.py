"""RankResources: one rank's device cache, host pool, storage, weight version and data path.

The one owner of what a worker moves bytes with. ``open`` builds everything in an order that
fails before it allocates (settings were validated by WorkerConfig; the host pool checks memory
before it touches any), ``sleep`` / ``wakeup`` detach and re-attach the device cache (and free /
rebuild the host pool when configured), ``close`` releases everything, whatever state it is in.

The weight version lives here too: ``keys`` is the KeyScheme in force now. An explicit version
(``update_weights(version=...)``) pins it until the next explicit update or an explicit re-read
of ``version.yaml`` (``update_weights()`` with no version); ``resume`` re-reads the file only
while the version is not pinned.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field

from kvtier.layout.keys import KeyScheme, read_weight_version
from kvtier.memory import shm
from kvtier.memory.device import DeviceCache
from kvtier.memory.host import HostLayout, HostPool, check_memory_available
from kvtier.storage import make_backend
from kvtier.storage.base import StorageBackend
from kvtier.worker.config import DeviceCacheMode, WorkerConfig
from kvtier.worker.datapath import DataPath
from kvtier.worker.removals import RemovedBlocks

log = logging.getLogger(__name__)


@dataclass
class VersionChange:
    """What a version update did, for the control answer."""

    previous: str
    current: str
    seen_before: bool = False  # a rollback: objects stored under it can be hit again

    @property
    def changed(self) -> bool:
        return self.previous != self.current


@dataclass
class WeightVersion:
    """The current KeyScheme, whether an explicit version pins it, and versions seen."""

    keys: KeyScheme
    pinned: bool = False
    seen: set[str] = field(default_factory=set)

    def is_rollback(self, version: str) -> bool:
        """Would switching to ``version`` make older KV hittable again? It was in force before,
        or it is an earlier ``RL-STEP<n>`` than the current one."""
        if version == self.keys.version:
            return False
        if version in self.seen:
            return True
        steps = [_step(v) for v in (version, self.keys.version)]
        return None not in steps and steps[0] < steps[1]  # type: ignore[operator]

    def set(self, version: str, *, pinned: bool) -> VersionChange:
        change = VersionChange(self.keys.version, version, version in self.seen)
        if change.changed:
            self.keys = self.keys.with_version(version)  # validates: ConfigError
        self.pinned = pinned
        self.seen.add(version)
        return change


def _step(version: str) -> int | None:
    match = re.fullmatch(r"RL-STEP(\d+)", version)
    return int(match.group(1)) if match else None


class RankResources:
    """Owns one rank's device cache, host pool, storage backend, versions and data path."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.layout = HostLayout(config.num_host_blocks, config.staging_blocks)
        self.device_cache: DeviceCache | None = None
        self.host_pool: HostPool | None = None
        self.storage: StorageBackend | None = None
        self.datapath: DataPath | None = None
        explicit = config.version is not None
        version = config.version if explicit else read_weight_version(config.model_dir)
        keys = KeyScheme(config.namespace, config.spec.fingerprint, config.rank, version or "")
        self.versions = WeightVersion(keys, pinned=explicit, seen={keys.version})
        self.removals = RemovedBlocks(lambda: self.versions.keys)

    @property
    def keys(self) -> KeyScheme:
        return self.versions.keys

    def open(self) -> RankResources:
        """Device cache, host pool, storage, data path; on failure nothing stays allocated."""
        cfg = self.config
        self._check_sizes()
        try:
            if cfg.device_cache_mode is DeviceCacheMode.CREATE:
                self.device_cache = DeviceCache.create(cfg.spec, cfg.device_cache_name, cfg.device)
            else:
                self.device_cache = DeviceCache.attach(cfg.spec, cfg.device_cache_name)
            self.host_pool = HostPool(cfg.spec, self.layout.total_blocks)
            self.storage = make_backend(cfg.spec, cfg.storage_config)
            self.storage.watch_removals(self.removals.keys_evicted)
            self.datapath = DataPath(self.device_cache, self.host_pool, self.layout, self.storage)
        except BaseException:
            self.close()
            raise
        return self

    def _check_sizes(self) -> None:
        """Every size against what the machine has, before anything is allocated."""
        cfg = self.config
        check_memory_available(cfg.spec.host_bytes(self.layout.total_blocks), "num_host_blocks")
        if cfg.device_cache_mode is DeviceCacheMode.CREATE and cfg.device == "cpu":
            shm.check_space(cfg.spec.device_bytes, f"device cache {cfg.device_cache_name!r}")

    def storage_summary(self) -> str:
        """One phrase for the start-up log: the backend, where it is, its capacity."""
        storage = self.storage
        if storage is None:
            return "none"
        usage = storage.usage()
        capacity = f"{usage.capacity_bytes / 2**30:.1f} GiB" if usage.capacity_bytes else "none"
        where = getattr(storage, "root", None) or self.config.storage.get("master_address")
        place = f" at {where}" if where else ""
        return f"{storage.kind}{place} (capacity {capacity}, {usage.num_objects} objects held)"

    # ---- versions ---------------------------------------------------------------------------

    def update_version(self, version: str | None) -> VersionChange | None:
        """An explicit version pins it; None re-reads version.yaml (None: file unreadable)."""
        if version is not None:
            return self._retire(self.versions.set(version, pinned=True))
        found = read_weight_version(self.config.model_dir)
        if not found:
            return None
        return self._retire(self.versions.set(found, pinned=False))

    def reread_version(self) -> VersionChange | None:
        """On resume: re-read version.yaml unless an explicit version pins the current one."""
        if self.versions.pinned or not self.config.model_dir:
            return None
        found = read_weight_version(self.config.model_dir)
        return self._retire(self.versions.set(found, pinned=False)) if found else None

    def _retire(self, change: VersionChange) -> VersionChange:
        """A new version makes every stored object unreachable: the engine hears so."""
        if change.changed:
            self.removals.retire_all()
        return change

    # ---- sleep ------------------------------------------------------------------------------

    def sleep(self) -> str:
        """Detach the device cache (and free the host pool when configured); say what was done."""
        assert self.device_cache is not None
        self.device_cache.detach()
        if self.config.free_host_pool_on_sleep:
            self._close_pool()
            return "detached the device cache and freed the host pool"
        return "detached the device cache"

    def wakeup(self) -> None:
        """Re-attach the device cache (checking its layout) and rebuild what sleep freed."""
        assert self.device_cache is not None and self.storage is not None
        self.device_cache.reattach()
        if self.host_pool is None:
            self.host_pool = HostPool(self.config.spec, self.layout.total_blocks)
            self.datapath = DataPath(self.device_cache, self.host_pool, self.layout, self.storage)

    def _close_pool(self) -> None:
        if self.datapath is not None:
            self.datapath.close()
            self.datapath = None
        if self.host_pool is not None:
            self.host_pool.close()
            self.host_pool = None

    def close(self) -> None:
        self._close_pool()
        if self.storage is not None:
            self.storage.close()
            self.storage = None
        if self.device_cache is not None:
            self.device_cache.close()
            self.device_cache = None
