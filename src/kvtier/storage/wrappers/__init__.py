"""Backends wrapped in another backend: ``faults`` injects latency, stalls, errors, corruption
and outages for tests and drills."""
