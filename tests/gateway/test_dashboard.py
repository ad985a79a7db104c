"""The Grafana dashboard in deploy/grafana queries only metrics the gateway exports, with the type
each query needs (rate() of counters and histogram buckets, gauges as they are)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import redis.asyncio as aioredis

from pagedserve.gateway.service.metrics import GatewayMetrics
from pagedserve.runtime.metric_names import HISTOGRAMS, WORKER_SERIES
from pagedserve.shared.keys import Keys

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pagedserve.json"


def exported_types() -> dict[str, str]:
    """Family name -> type, of everything the gateway's /metrics can show."""
    gateway = GatewayMetrics(aioredis.Redis(), Keys(), "m")  # no connection is made before a scrape
    kinds = {family.name: family.type for family in gateway.registry.collect()}
    kinds.update({series.name: "counter" if series.counter else "gauge" for series in WORKER_SERIES.values()})
    kinds.update({name: "histogram" for name, _ in HISTOGRAMS.values()})
    return kinds


def test_every_dashboard_query_names_an_exported_metric_of_the_right_type():
    exprs = [t["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for t in panel["targets"]]
    kinds = exported_types()
    used = set()
    for expr in exprs:
        for name in re.findall(r"(?:vllm|pagedserve):[a-z0-9_]+", expr):
            used.add(name)
            if name.endswith("_bucket"):
                assert kinds.get(name.removesuffix("_bucket")) == "histogram", name
            elif name.endswith("_total"):
                assert kinds.get(name.removesuffix("_total")) == "counter", name
            else:
                assert kinds.get(name) == "gauge", name
    assert len(used) >= 15  # the panels cover the metrics, not a handful
