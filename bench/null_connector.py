"""A KV connector that does nothing: vLLM's connector machinery alone, for ``bench serve``.

vLLM runs extra code for any configured connector (a metadata object per step, the connector's
hooks around every forward pass, the scheduler's external-hit path) and, on CPU, reserves a core
for it. ``kvtier bench serve --null-connector`` runs a third server with this connector, which
finds nothing and saves nothing, so its ratio to the server without a connector is what the
machinery costs before any connector does work: the floor under kvtier's overhead on misses.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)


class NullConnector(KVConnectorBase_V1):
    """Every hook a no-op: no external hits, no loads, no saves."""

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int):
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any):
        return None

    def wait_for_save(self) -> None:
        return None
