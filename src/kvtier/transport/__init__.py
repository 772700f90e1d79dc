"""How engines and workers talk: the messages, the transports (ZeroMQ, in-process), CURVE
authentication, one live worker per endpoint.

Layering: docs/architecture.md (enforced by tests/unit/test_structure.py)."""
