"""Where settings come from: sources merged field by field, and the one unknown-key check.

Every entry point that configures a worker (``kvtier serve``, ``Client.launch``, the vLLM
connector) resolves its settings the same way: the sources in order — a YAML file, the
``KVTIER_*`` environment, then flags or call arguments — each overriding the earlier ones
field by field. Mappings (``spec``, ``storage`` and ``storage.faults``) merge key by key, so
``--storage-backend file`` over a YAML ``storage: {root: /data, capacity_bytes: ...}`` keeps the
root and the capacity. ``None`` means "not set here". Every merged field remembers its source,
and a ``ConfigError`` about it says where the value came from.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError


def refuse_unknown(
    data: Mapping[str, Any], allowed: Iterable[str], field_prefix: str = "", what: str = "setting"
) -> None:
    """ConfigError naming the first key of ``data`` that is not ``allowed``."""
    known = set(allowed)
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"{field_prefix}{unknown[0]}", f"unknown {what}; allowed: {', '.join(sorted(known))}"
        )


def positive(field: str, value: Any, *, integer: bool = False) -> None:
    """ConfigError naming ``field`` unless ``value`` is a number > 0 (an integer if asked)."""
    kinds = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        what = "a positive integer" if integer else "a positive number"
        raise ConfigError(field, f"must be {what}, got {value!r}")


@dataclass(frozen=True)
class Source:
    """Settings from one place (``when_backend``: only where the storage is that backend).
    ``labels`` name a field's origin more precisely than ``name`` (``KVTIER_RANK``)."""

    name: str
    values: Mapping[str, Any]
    labels: Mapping[str, str] = field(default_factory=dict)
    when_backend: str | None = None  # applies only where the merged storage is this backend

    def label(self, path: str) -> str:
        return self.labels.get(path) or self.labels.get(path.split(".", 1)[0]) or self.name


@dataclass
class Merged:
    """The merged settings and, per dotted field (``storage.root``), the source that set it."""

    values: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict)

    def origin(self, config_field: str) -> str | None:
        """Where ``config_field`` (as a ConfigError names it) was set, if anywhere."""
        for path in (config_field, f"spec.{config_field}"):
            if path in self.origins:
                return self.origins[path]
        head = config_field.split(".", 1)[0]
        return self.origins.get(head)

    def explain(self, error: ConfigError) -> ConfigError:
        """``error`` with the source of its field appended (unchanged when it has none)."""
        source = self.origin(error.field)
        if source is None:
            return error
        return ConfigError(error.field, f"{error.detail} (set by {source})")


NESTED = frozenset({"spec", "storage", "storage.faults"})  # merged key by key


def merge(sources: Sequence[Source]) -> Merged:
    """The sources in order, later ones winning field by field (see the module docstring)."""
    plain = [s for s in sources if s.when_backend is None]
    storage = _merge_all(plain).values.get("storage")
    backend = storage.get("backend", "file") if isinstance(storage, Mapping) else None
    return _merge_all([s for s in sources if s.when_backend in (None, backend)])


def _merge_all(sources: Sequence[Source]) -> Merged:
    merged = Merged()
    for source in sources:
        _merge_into(merged, merged.values, source.values, source, "")
    return merged


def _merge_into(
    merged: Merged, target: dict[str, Any], values: Mapping[str, Any], source: Source, prefix: str
) -> None:
    for key, value in values.items():
        if value is None:
            continue
        path = f"{prefix}{key}"
        if hasattr(value, "to_dict") and path == "spec":  # a KVCacheSpec object
            value = value.to_dict()
        if path in NESTED and isinstance(value, Mapping):
            inner = target.get(key)
            if not isinstance(inner, dict):
                inner = target[key] = {}
            merged.origins.setdefault(path, source.label(path))
            _merge_into(merged, inner, value, source, f"{path}.")
        else:
            target[key] = value
            merged.origins[path] = source.label(path)
