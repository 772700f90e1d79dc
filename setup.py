"""Builds kvtier's one C extension (the batched piece copier); everything else is in pyproject.

The extension is optional: without a C compiler the install still succeeds, and kvtier uses its
two-pass torch copier (about half as fast), saying so once when a copier is made.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier._copy",
            sources=["src/kvtier/_copy.c"],
            include_dirs=["src/kvtier"],
            depends=["src/kvtier/third_party/xxhash.h"],
            extra_compile_args=["-O3", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
