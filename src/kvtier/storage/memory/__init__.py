"""The memory backend: a dict of objects (unbounded, ``store``) or a preallocated slab evicting
least recently used objects (``arena`` over ``arena_memory``: the memory tier of a chain)."""
