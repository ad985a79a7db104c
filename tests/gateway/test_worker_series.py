"""The gateway's ``/metrics`` joins the workers' numbers as each series says (``runtime/
metric_names.py``): counters and loads summed, the cache's usage averaged, the stream's depth (which
every worker reads alike) its largest report. The workers' hashes are written into a real Redis as
their heartbeats write them, the exposition parsed by prometheus_client."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.gateway.service.metrics import GatewayMetrics
from pagedserve.runtime.redis_client import connect
from pagedserve.shared.keys import Keys
from tests.service_helpers import MODEL_NAME

WORKERS = {
    "w1": {"num_requests_running": 3, "kv_cache_usage_perc": 0.5, "cow_copies_total": 7, "kv_blocks_saved_by_sharing": 12,
           "queue_depth": 40, "dead_letters": 2, "num_preemptions_total": 1, "generation_tokens_per_s": 10.5},
    "w2": {"num_requests_running": 5, "kv_cache_usage_perc": 0.25, "cow_copies_total": 4, "kv_blocks_saved_by_sharing": 0,
           "queue_depth": 38, "dead_letters": 2, "num_preemptions_total": 2, "generation_tokens_per_s": 20.0},
}
JOINED = {"vllm:num_requests_running": 8, "vllm:kv_cache_usage_perc": 0.375, "pagedserve:kv_cow_copies_total": 11,
          "pagedserve:kv_blocks_saved_by_sharing": 12, "pagedserve:queue_depth": 40, "pagedserve:dead_letters": 2,
          "vllm:num_preemptions_total": 3, "pagedserve:generation_tokens_per_s": 30.5}


def test_the_workers_numbers_are_joined_as_each_series_says(redis_server):
    keys = Keys()

    async def render() -> bytes:
        r = connect(redis_server.url)
        try:
            for name, values in WORKERS.items():
                await r.hset(keys.metrics(MODEL_NAME, name), mapping=values)
            await r.hset(keys.metrics("another-model", "w9"), mapping={"num_requests_running": 100})
            return await GatewayMetrics(r, keys, MODEL_NAME).render()
        finally:
            await r.aclose()

    samples = {s.name: s for family in text_string_to_metric_families(asyncio.run(render()).decode())
               for s in family.samples if s.labels.get("model_name") == MODEL_NAME}
    assert {name: samples[name].value for name in JOINED} == JOINED
