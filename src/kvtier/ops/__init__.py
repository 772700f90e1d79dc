"""What an operator types: the ``kvtier`` command, the demo, status, store tools, the P/D proxy.

Layering: docs/architecture.md (enforced by tests/unit/test_structure.py)."""
