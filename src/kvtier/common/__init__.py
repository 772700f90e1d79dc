"""What every layer uses: merged configuration sources, interrupts, CPU lists, directories
the user names, the bind guard, the bounded HTTP server.

Layering: docs/architecture.md (enforced by tests/unit/test_structure.py)."""
