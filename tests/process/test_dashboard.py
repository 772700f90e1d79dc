"""The Grafana dashboard queries only what a live worker really serves."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from worker_helpers import scrape_a_busy_worker

DASHBOARDS = Path(__file__).resolve().parents[2] / "dashboards"
METRIC = re.compile(r"\b(kvtier_[a-z_]+)")
LABEL = re.compile(r"\b(?:by \(([a-z_, ]+)\)|([a-z_]+)\s*(?:=~|!=|=)\s*\")")


def _build():
    spec = importlib.util.spec_from_file_location("dashboard_build", DASHBOARDS / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _queries(dashboard: dict) -> list[str]:
    exprs = [tg["expr"] for p in dashboard["panels"] for tg in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return exprs


def test_the_dashboard_is_what_its_builder_makes() -> None:
    committed = (DASHBOARDS / "kvtier-workers.json").read_text()
    assert committed == _build().render(), "run: python dashboards/build.py"
    dashboard = json.loads(committed)
    assert dashboard["uid"] == "kvtier-workers"
    assert sum(1 for p in dashboard["panels"] if p["type"] != "row") >= 10


def test_every_metric_and_label_the_dashboard_queries_is_served(tmp_path) -> None:
    text = scrape_a_busy_worker(tmp_path)
    served: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("kvtier_"):
            name, _, rest = line.partition("{")
            labels = {pair.split("=")[0] for pair in rest.split("}")[0].split(",") if pair}
            served.setdefault(name, set()).update(labels | {"le"} if "_bucket" in name else labels)
    queries = _queries(json.loads((DASHBOARDS / "kvtier-workers.json").read_text()))
    assert queries
    for expr in queries:
        names = METRIC.findall(expr)
        assert names, expr
        for name in names:
            assert name in served, f"{name} is queried but no worker serves it ({expr})"
        labels = set()
        for by, matched in LABEL.findall(expr):
            labels |= {x.strip() for x in by.split(",")} if by else {matched}
        labels -= {"instance"}  # added by Prometheus at scrape time
        for label in labels:
            assert any(label in served[n] for n in names), f"label {label!r} in {expr}"
