"""Builds kvtier's C parts; everything else is in pyproject.

- ``kvtier._copy``: the batched piece copier. Without it kvtier uses its two-pass torch copier
  (about half as fast), saying so once when a copier is made. Its hashing kernels are built
  twice (``copy_kernels.h``: SSE2, and AVX2 in ``_copy_avx2.c``); the CPU picks at import.
- ``kvtier._fileio``: a file-store object read (and hashed) or written in one call without the
  GIL. Without it the store does the same in Python (slower with several I/O threads).
- ``kvtier._bindguard``: not a Python module but a preloaded library that keeps Mooncake's
  listeners on the configured host (see kvtier/common/bindguard.py). Without it kvtier says so once.

Both are optional: without a C compiler the install still succeeds.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier._copy",
            sources=["src/kvtier/_copy.c", "src/kvtier/_copy_avx2.c"],
            include_dirs=["src/kvtier"],
            depends=["src/kvtier/third_party/xxhash.h", "src/kvtier/copy_kernels.h"],
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "kvtier._fileio",
            sources=["src/kvtier/_fileio.c"],
            include_dirs=["src/kvtier"],
            depends=["src/kvtier/third_party/xxhash.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "kvtier._bindguard",
            sources=["src/kvtier/_bindguard.c"],
            extra_compile_args=["-O2", "-pthread"],
            extra_link_args=["-pthread"],
            libraries=["dl"],
            optional=True,
        ),
    ]
)
