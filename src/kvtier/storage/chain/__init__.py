"""A tier chain: backends fastest first behind one backend (``store``); saves reach the lower
tiers through a writer (``writer``), through or back."""
