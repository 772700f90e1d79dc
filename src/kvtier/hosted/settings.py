"""The settings an engine's own offloading passes to kvtier's store (checked once, fields named).

Each engine hands its plug-in a free-form mapping (SGLang's ``extra_config``, LMCache's
``adapter_params``, vLLM's secondary tier entry); the part kvtier reads is the same everywhere:

- ``storage``: kvtier's storage mapping (``docs/storage.md``): a backend or a tier chain.
  Default ``{"backend": "file"}`` under ``$XDG_CACHE_HOME/kvtier/store``.
- ``namespace``: names the model in every key. Default: the engine's model name.
- ``weight_version``: the weights' version in every key (a store written under other weights is
  never read). Or ``model_dir``: read from ``<model_dir>/version.yaml`` and read again when that
  file changes, so an RL trainer's weight update needs no restart. Neither: empty.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError

KNOWN = ("storage", "namespace", "weight_version", "model_dir")


@dataclass(frozen=True)
class HostedSettings:
    storage: Mapping[str, Any] = field(default_factory=lambda: {"backend": "file"})
    namespace: str = ""
    weight_version: str | None = None
    model_dir: str | None = None

    @classmethod
    def parse(
        cls, data: Mapping[str, Any], prefix: str, ignore: tuple[str, ...] = ()
    ) -> HostedSettings:
        """The kvtier part of ``data``; ``prefix`` names where it came from in error messages
        (``adapter_params``); keys in ``ignore`` belong to the engine and are passed over."""
        if not isinstance(data, Mapping):
            raise ConfigError(prefix, f"must be a mapping, got {type(data).__name__}")
        unknown = sorted(set(data) - set(KNOWN) - set(ignore))
        if unknown:
            raise ConfigError(
                f"{prefix}.{unknown[0]}", f"unknown setting; allowed: {', '.join(KNOWN)}"
            )
        storage = data.get("storage", {"backend": "file"})
        if not isinstance(storage, Mapping):
            raise ConfigError(f"{prefix}.storage", "must be a storage mapping (docs/storage.md)")
        texts = {}
        for name in ("namespace", "weight_version", "model_dir"):
            value = data.get(name)
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{prefix}.{name}", f"must be text, got {value!r}")
            texts[name] = value
        if texts["weight_version"] is not None and texts["model_dir"] is not None:
            raise ConfigError(
                f"{prefix}.weight_version", "give weight_version or model_dir, not both"
            )
        return cls(
            storage=dict(storage),
            namespace=texts["namespace"] or "",
            weight_version=texts["weight_version"],
            model_dir=texts["model_dir"],
        )
