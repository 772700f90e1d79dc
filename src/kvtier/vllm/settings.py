"""The connector's settings: ``kv_connector_extra_config``, validated; errors name the field."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

from kvtier.common.config_sources import positive, refuse_unknown
from kvtier.common.cpus import parse_cpu_list
from kvtier.errors import ConfigError
from kvtier.storage import StorageConfig, parse_storage

PREFIX = "kv_connector_extra_config"
KV_EVENTS = ("auto", "any_interface", "off")
LOAD_MODES = ("auto", "async", "sync")


@dataclass(frozen=True)
class ConnectorSettings:
    """What the user sets (all optional).

    - ``storage``: exactly what ``kvtier.storage.make_backend`` takes (file, mooncake, memory,
      faults); default: the file store in ``$XDG_CACHE_HOME/kvtier/store``.
    - ``namespace``: the model id in every key (default: the model path's last component); the
      prefix-caching hash algorithm is appended, so hashes of two algorithms never share keys.
    - ``version`` / ``model_dir``: the weight version (see kvtier's update_weights).
    - ``instance_id``: names this engine's workers and caches (default: vLLM's instance id).
    - ``load_mode``: ``auto`` (default: per request, ``sync`` for a load estimated shorter
      than a step, ``async`` otherwise — ``kvtier.vllm.decide``), ``async`` (a hit waits in
      WAITING_FOR_REMOTE_KVS while other requests run) or ``sync`` (loads run before the
      step's forward, which waits for them). A load within the step that stalls holds an
      ``auto`` step 1 s at most (``decide.IN_STEP_WAIT_S``; ``sync``: until it is answered,
      ``task_timeout_s`` at most); its blocks are then recomputed while it goes on, and its
      request keeps them until it is answered.
    - ``load_or_recompute``: decline a hit whose load is estimated slower than recomputing it,
      from measured rates (default True; ``kvtier.vllm.decide``; counted in
      ``declined_tokens``).
    - ``save_generated``: save full blocks of generated tokens too (default True: a chat's
      next turn, its prompt = the earlier turns + the answer + a new message, hits the answer).
    - ``worker_cores``: where each rank's kvtier worker runs: ``reserved`` (default: the cores
      vLLM keeps free of compute; with an explicit ``VLLM_CPU_OMP_THREADS_BIND``, which reserves
      none, this rank's own cores — see ``kvtier.vllm.placement``), ``inherit`` (the vLLM
      worker's own affinity, its first compute core) or a CPU list (``"3"``, ``"2-3"``).
    - ``staging_blocks``: blocks per storage step in each worker (default 16).
    - ``start_timeout_s``, ``task_timeout_s``: worker start and per-task bounds.
    - ``metrics_port``: kvtier's own Prometheus exporter per worker (port + rank; 0: any).
    - ``log_dir``: keep the kvtier workers' logs there, made (0700) if missing (default: removed at
      shutdown).
    - ``kv_events``: add what kvtier stores and removes to vLLM's KV events
      (``--kv-events-config``; ``kvtier.vllm.events``): ``auto`` (default: when vLLM publishes
      them on an endpoint bound to a host), ``any_interface`` (also on a wildcard ``tcp://*``),
      ``off``.
    """

    storage: dict[str, Any] | None = None  # None: KVTIER_STORAGE*, else the file store
    namespace: str | None = None
    version: str | None = None
    model_dir: str | None = None
    instance_id: str | None = None
    load_mode: str = "auto"
    load_or_recompute: bool = True
    save_generated: bool = True
    worker_cores: str = "reserved"
    staging_blocks: int = 16
    start_timeout_s: float = 120.0
    task_timeout_s: float = 120.0
    metrics_port: int | None = None
    log_dir: str | None = None
    kv_events: str = "auto"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        data = dict(extra or {})
        refuse_unknown(data, (f.name for f in fields(cls)), f"{PREFIX}.", "kvtier setting")
        settings = cls(**data)
        settings.check()
        return settings

    @cached_property
    def storage_config(self) -> StorageConfig:
        """The storage the workers run, parsed once: the ``KVTIER_STORAGE*`` environment, then
        ``storage`` key by key, merged as the launcher merges them for the workers
        (``kvtier.engine.launcher``). The scheduler's tier count and the KV events' backend
        name read it, so they describe the store the workers open, whatever set it."""
        # local: the worker's settings machinery, for the environment's storage variables only
        from kvtier.common.config_sources import Source, merge
        from kvtier.worker.config import env_sources

        given = Source(f"{PREFIX}.storage", {"storage": self.storage})
        merged = merge([*env_sources(os.environ), given])
        try:
            return parse_storage(merged.values.get("storage"))
        except ConfigError as e:
            raise merged.explain(e) from None

    def check(self) -> None:
        if self.storage is not None and not isinstance(self.storage, Mapping):
            raise ConfigError(f"{PREFIX}.storage", "must be a mapping with a 'backend' key")
        _ = self.storage_config  # the storage the workers will run, checked now (parsed once)
        for name in ("start_timeout_s", "task_timeout_s"):
            positive(f"{PREFIX}.{name}", getattr(self, name))
        if self.kv_events not in KV_EVENTS:
            raise ConfigError(
                f"{PREFIX}.kv_events", f"got {self.kv_events!r}; allowed: {', '.join(KV_EVENTS)}"
            )
        if self.load_mode not in LOAD_MODES:
            raise ConfigError(
                f"{PREFIX}.load_mode", f"got {self.load_mode!r}; allowed: {', '.join(LOAD_MODES)}"
            )
        if self.worker_cores not in ("reserved", "inherit"):
            parse_cpu_list(str(self.worker_cores), f"{PREFIX}.worker_cores")
        if not isinstance(self.save_generated, bool):
            raise ConfigError(f"{PREFIX}.save_generated", "must be true or false")
        if isinstance(self.staging_blocks, bool) or not isinstance(self.staging_blocks, int):
            raise ConfigError(f"{PREFIX}.staging_blocks", "must be an integer >= 1")
        if self.staging_blocks < 1:
            raise ConfigError(f"{PREFIX}.staging_blocks", "must be an integer >= 1")
        if self.instance_id is not None and not re.fullmatch(
            r"[A-Za-z0-9_.-]{1,40}", str(self.instance_id)
        ):
            raise ConfigError(f"{PREFIX}.instance_id", "must be 1-40 letters, digits, '._-'")


def default_namespace(model: str, hash_algo: str) -> str:
    """``<model name>.<hash algorithm>``, reduced to what a key allows."""
    name = str(model).rstrip("/").rsplit("/", 1)[-1] or "model"
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[:80]}.{hash_algo}"


def instance_name(vllm_instance_id: str) -> str:
    """A kvtier instance id from vLLM's (which may hold characters names cannot)."""
    return "vllm" + re.sub(r"[^A-Za-z0-9]", "", str(vllm_instance_id))[-24:]
