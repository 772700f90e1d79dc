"""What the bytes and keys mean: the cache's shapes (``KVCacheSpec``), block hashes and storage
keys, the payload checksum, block ids.

Layering: docs/architecture.md (enforced by tests/unit/test_structure.py)."""
