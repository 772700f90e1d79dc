"""What a third-party backend needs to prove itself: the storage contract suite
(``kvtier.testing.contract``), run by pytest. Nothing in kvtier imports this package."""
