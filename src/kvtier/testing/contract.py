"""The storage contract suite: every backend's test class subclasses ``StoreContract``.

A subclass provides ``make_store(spec)`` (a fresh backend over shared state per test, so a
second instance built the same way sees the same objects when the backend persists), and sets
``persistent`` / ``multi_process`` for what the backend promises (``store_config()`` too, for
the second process). A third-party backend runs the same suite::

    from kvtier.testing.contract import CONTRACT_SPEC, StoreContract

    class TestMyStore(StoreContract):
        persistent = True

        def make_store(self, spec):
            return MyStore(spec, ...)

It needs pytest (``pip install kvtier[test]``).
"""

from __future__ import annotations

from kvtier.testing.contract_base import (
    CONTRACT_SPEC,
    MAC_KEY,
    ContractBase,
    authenticated,
    expected_block,
    make_keys,
    reseal,
    store_round_trip,
)
from kvtier.testing.contract_data import DataContract
from kvtier.testing.contract_integrity import IntegrityContract


class StoreContract(DataContract, IntegrityContract):
    """The whole contract."""


__all__ = [
    "CONTRACT_SPEC",
    "MAC_KEY",
    "ContractBase",
    "StoreContract",
    "authenticated",
    "expected_block",
    "make_keys",
    "reseal",
    "store_round_trip",
]
