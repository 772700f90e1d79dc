"""The kvtier worker process: its configuration, loop, admission, data tasks, control plane,
counters and exporter.

Layering: docs/architecture.md (enforced by tests/unit/test_structure.py)."""
