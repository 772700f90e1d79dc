"""kvtier's storage as an LMCache L2 adapter: ``{"type": "plugin", "module_path":
"kvtier.lmcache", "class_name": "KvtierL2Adapter", "adapter_params": {...}}`` (docs/lmcache.md).
LMCache finds the settings class by its name, ``KvtierL2AdapterConfig``, in this module."""

from kvtier.lmcache.adapter import KvtierL2Adapter
from kvtier.lmcache.parts import KvtierL2AdapterConfig

__all__ = ["KvtierL2Adapter", "KvtierL2AdapterConfig"]
