"""Builds kvtier-workers.json, the Grafana dashboard for the metrics kvtier workers export.

    python dashboards/build.py            # rewrite dashboards/kvtier-workers.json

Edit the panels here, not the JSON: tests/test_dashboard.py checks that the JSON is what this
script builds and that every metric it queries is one a live worker serves.
"""

from __future__ import annotations

import json
from pathlib import Path

OUT = Path(__file__).with_name("kvtier-workers.json")
SEL = 'instance=~"$instance", rank=~"$rank"'
DS = {"type": "prometheus", "uid": "${datasource}"}


def panel(title, exprs, unit, x, y, w=12, h=8, kind="timeseries", description=""):
    """One panel; ``exprs`` is [(PromQL, legend)]."""
    p = {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"h": h, "w": w, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i), "datasource": DS}
            for i, (expr, legend) in enumerate(exprs)
        ],
    }
    if kind == "timeseries":
        p["options"] = {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    return p


def row(title, y):
    return {
        "type": "row",
        "title": title,
        "collapsed": False,
        "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
        "panels": [],
    }


def quantile(q):
    return (
        f"histogram_quantile({q}, sum by (le, kind) "
        f"(rate(kvtier_task_seconds_bucket{{{SEL}}}[$__rate_interval])))"
    )


def panels():
    rate = "$__rate_interval"
    return [
        row("Throughput", 0),
        panel(
            "Tasks per second, by kind",
            [(f"sum by (kind) (rate(kvtier_tasks_total{{{SEL}}}[{rate}]))", "{{kind}}")],
            "ops",
            0,
            1,
        ),
        panel(
            "Bytes moved per second, by kind",
            [(f"sum by (kind) (rate(kvtier_task_bytes_sum{{{SEL}}}[{rate}]))", "{{kind}}")],
            "Bps",
            12,
            1,
            description="Sum over ranks: each rank moves its own shard of every block.",
        ),
        row("Latency", 9),
        panel("Task latency p50, by kind", [(quantile(0.5), "{{kind}}")], "s", 0, 10),
        panel("Task latency p99, by kind", [(quantile(0.99), "{{kind}}")], "s", 12, 10),
        row("Storage", 18),
        panel(
            "Storage reads per second: hit, miss, corrupt",
            [
                (
                    f"sum by (result) (rate(kvtier_storage_blocks_total{{{SEL}}}[{rate}]))",
                    "{{result}}",
                )
            ],
            "ops",
            0,
            19,
            w=8,
        ),
        panel(
            "Storage hit ratio",
            [
                (
                    f'sum(rate(kvtier_storage_blocks_total{{{SEL}, result="hit"}}[{rate}])) / '
                    f"sum(rate(kvtier_storage_blocks_total{{{SEL}}}[{rate}]))",
                    "hit ratio",
                )
            ],
            "percentunit",
            8,
            19,
            w=8,
        ),
        panel(
            "Storage writes per second: ok, failed",
            [(f"sum by (result) (rate(kvtier_storage_puts_total{{{SEL}}}[{rate}]))", "{{result}}")],
            "ops",
            16,
            19,
            w=8,
        ),
        row("Health", 27),
        panel(
            "Worker state per rank",
            [
                (
                    f"max by (rank, state) (kvtier_worker_state{{{SEL}}}) == 1",
                    "rank {{rank}}: {{state}}",
                )
            ],
            "none",
            0,
            28,
            w=8,
            kind="stat",
            description=(
                "The current state of each rank: running, paused, sleeping, waking, stopping."
            ),
        ),
        panel(
            "Queue depth, by direction and rank",
            [
                (
                    f"sum by (direction, rank) (kvtier_queue_depth{{{SEL}}})",
                    "{{direction}} rank {{rank}}",
                )
            ],
            "short",
            8,
            28,
            w=8,
        ),
        panel(
            "Failed tasks and errors per second",
            [
                (
                    "sum by (kind, status) "
                    f'(rate(kvtier_tasks_total{{{SEL}, status!="ok"}}[{rate}]))',
                    "{{kind}} {{status}}",
                ),
                (f"sum by (kind) (rate(kvtier_errors_total{{{SEL}}}[{rate}]))", "error: {{kind}}"),
            ],
            "ops",
            16,
            28,
            w=8,
        ),
    ]


def variable(name, query, label):
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-values"},
        "definition": query,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "refresh": 2,
        "sort": 3,
    }


def dashboard():
    return {
        "title": "kvtier workers",
        "uid": "kvtier-workers",
        "description": (
            "Tasks, bytes, latency, storage and health of kvtier workers (one series per rank)."
        ),
        "tags": ["kvtier", "kv-cache"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                },
                variable(
                    "instance", "label_values(kvtier_worker_state, instance)", "scrape target"
                ),
                variable(
                    "rank", 'label_values(kvtier_worker_state{instance=~"$instance"}, rank)', "rank"
                ),
            ]
        },
        "panels": panels(),
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
