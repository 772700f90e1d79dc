"""Where blocks live in memory: named shared-memory files, the device cache, the host pool, and
the copies between them.

Layering: docs/architecture.md (enforced by tests/unit/test_structure.py)."""
