"""The engine's side: ``Client``, its I/O thread and direct calls, one answer from every rank,
launching workers, the cache index.

Layering: docs/architecture.md (enforced by tests/unit/test_structure.py)."""
