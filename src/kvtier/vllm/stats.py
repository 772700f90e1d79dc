"""True hit counts: what the connector looked up, found, loaded and failed, per interval.

vLLM counts a hit when the scheduler accepts it, even if its load later fails. These counters
say what really happened: ``requested_tokens`` (looked up), ``found_tokens`` (stored on every
rank), ``loaded_tokens`` (verified and in the engine's blocks), ``failed_tokens`` (reported to
vLLM for recompute), plus bytes and seconds of loads and saves. They reach vLLM's logger
(``get_kv_connector_stats``) and its Prometheus endpoint as ``vllm:kvtier_*`` counters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

COUNTERS = {
    "lookups": "requests looked up in kvtier",
    "lookup_round_trips": "lookups sent to the kvtier workers (a waiting request's answer is kept)",
    "lookup_microseconds": "time vLLM's scheduler waited for those lookups' answers (microseconds)",
    "lookups_skipped": "requests not looked up: any hit would be declined (load_or_recompute)",
    "requested_tokens": "prompt tokens looked up in kvtier",
    "found_tokens": "tokens kvtier holds on every rank (accepted hits)",
    "declined_tokens": "stored tokens not loaded: their recompute was estimated faster",
    "loaded_tokens": "tokens loaded, verified, in vLLM's blocks (summed over ranks)",
    "in_step_loaded_tokens": "found tokens loaded within the step that schedules them (load_mode)",
    "failed_tokens": "tokens whose load failed and that vLLM recomputed (summed over ranks)",
    "load_bytes": "bytes loaded into vLLM's KV cache",
    "load_microseconds": "time kvtier workers spent loading (microseconds)",
    "load_core_wait_microseconds": "of that, the loading threads' waits for a core (a busy host)",
    "saved_tokens": "tokens written to storage (summed over ranks)",
    "skipped_tokens": "tokens to save that were already stored: not written again (summed)",
    "save_bytes": "bytes written to storage",
    "save_failures": "save tasks that failed",
    "save_tasks": "save tasks sent (one per step that saves)",
    "unsaved_tokens": "tokens not saved: a load of them would be declined (load_or_recompute)",
}


# The load-or-recompute estimates in force (``kvtier.vllm.decide.LoadOrRecompute.estimates``):
# gauges, ``estimate_<name>`` in the stats (the latest value, never summed) and
# ``vllm:kvtier_estimate_seconds{what="<name>"}`` in Prometheus (per tier: ``what`` is e.g.
# ``load_s_per_block`` with ``tier="0"``).
ESTIMATE = "estimate_"
ESTIMATE_TIER = re.compile(r"tier(\d+)_(.+)")

# Loaded tokens per storage tier (0 = the fastest; one backend is tier 0): ``tier<N>_loaded_tokens``
# in the stats, ``vllm:kvtier_tier_loaded_tokens{tier="N"}`` in Prometheus.
TIER_COUNTER = re.compile(r"tier(\d)_loaded_tokens")


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    def add(self, **counts: float) -> None:
        for name, value in counts.items():
            self.data[name] = self.data.get(name, 0) + value

    def set_estimates(self, estimates: dict[str, float]) -> None:
        """The decision's estimates now (gauges: they replace the ones held)."""
        for name in [k for k in self.data if k.startswith(ESTIMATE)]:
            del self.data[name]
        self.data.update((ESTIMATE + name, value) for name, value in estimates.items())

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other is not None and not other.is_empty():
            if any(k.startswith(ESTIMATE) for k in other.data):  # newer gauges replace older
                self.set_estimates(
                    {k[len(ESTIMATE) :]: v for k, v in other.data.items() if k.startswith(ESTIMATE)}
                )
            for name, value in other.data.items():
                if not name.startswith(ESTIMATE):
                    self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {k: self.data.get(k, 0) for k in COUNTERS}
        out.update((k, v) for k, v in sorted(self.data.items()) if TIER_COUNTER.fullmatch(k))
        out.update((k, v) for k, v in sorted(self.data.items()) if k.startswith(ESTIMATE))
        seconds = out["load_microseconds"] / 1e6
        out["load_gbps"] = round(out["load_bytes"] / seconds / 1e9, 3) if seconds else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvtierPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvtier_<counter>`` per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for name, text in COUNTERS.items():
            counter = self._counter_cls(
                name=f"vllm:kvtier_{name}", documentation=f"kvtier: {text}", labelnames=labelnames
            )
            self.counters[name] = {
                idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()
            }
        self.per_engine = per_engine_labelvalues
        self.tier_counter: Any = self._counter_cls(
            name="vllm:kvtier_tier_loaded_tokens",
            documentation="kvtier: tokens loaded from each storage tier (0 = the fastest)",
            labelnames=[*labelnames, "tier"],
        )
        gauge: Any = self._gauge_cls  # vLLM's Gauge class (typed as any metric class)
        self.estimate_gauge: Any = gauge(
            name="vllm:kvtier_estimate_seconds",
            documentation=(
                "kvtier load or recompute: the estimate in force (what: prefill_s_per_token, "
                "step_s, load_fixed_s and load_s_per_block per tier, save_floor_s_per_block)"
            ),
            labelnames=[*labelnames, "what", "tier"],
            multiprocess_mode="mostrecent",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self.counters.get(name)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)
            tier = TIER_COUNTER.fullmatch(name)
            if tier is not None and value:
                labels = self.per_engine[engine_idx]
                self.tier_counter.labels(*labels, tier.group(1)).inc(value)
            if name.startswith(ESTIMATE):
                what = name[len(ESTIMATE) :]
                per_tier = ESTIMATE_TIER.fullmatch(what)
                tier_label = per_tier.group(1) if per_tier else ""
                what = per_tier.group(2) if per_tier else what
                labels = self.per_engine[engine_idx]
                self.estimate_gauge.labels(*labels, what, tier_label).set(value)
