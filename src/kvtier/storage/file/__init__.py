"""The file backend: one checksummed object per block under a directory tree on local disk.

``store`` the backend, ``config`` its options, ``dirs`` the directory tree it trusts, ``objects``
one object's files, ``index`` the recency order that eviction follows, ``io`` the reads and writes
(the C extension and its Python fallback), ``admin`` what ``kvtier store`` does with a store it
does not run. Importing this package loads nothing heavy: the config parses without torch.
"""
