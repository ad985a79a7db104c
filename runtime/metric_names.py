"""The Prometheus names and types of the workers' numbers, for the worker's own endpoint and the
gateway's sum over workers: vLLM's V1 names where vLLM has the metric (so its dashboards and alerts
work unchanged), ``pagedserve:`` for the ones only pagedserve has. Counters are exported as
counters (``_total`` added by the exposition), gauges as gauges, histograms (``HISTOGRAMS``) from
their flat cumulative numbers (``{key}_le_{bound}``, ``{key}_count``, ``{key}_sum``: summed over
workers like counters) as histograms."""

from __future__ import annotations

from dataclasses import dataclass
from statistics import fmean
from typing import Callable, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric


@dataclass(frozen=True)
class Series:
    name: str  # exported name (counters without the _total the exposition adds)
    counter: bool
    combine: Callable[[Iterable[float]], float]  # how the gateway joins the workers' values
    help: str


WORKER_SERIES = {  # the key a worker stores in Redis -> how it is exported
    "num_requests_running": Series("vllm:num_requests_running", False, sum, "requests in the running batch"),
    "num_requests_waiting": Series("vllm:num_requests_waiting", False, sum, "requests read but not running yet"),
    "kv_cache_usage_perc": Series("vllm:kv_cache_usage_perc", False, fmean, "share of KV blocks in use (1 = full)"),
    "num_preemptions_total": Series("vllm:num_preemptions", True, sum, "preemptions (recompute or swap)"),
    "prefix_cache_queries_total": Series("vllm:prefix_cache_queries", True, sum, "prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits_total": Series("vllm:prefix_cache_hits", True, sum, "prompt tokens found in the prefix cache"),
    "num_requests_swapped": Series("pagedserve:num_requests_swapped", False, sum, "requests swapped to CPU memory"),
    "cow_copies_total": Series("pagedserve:kv_cow_copies", True, sum, "copy-on-write copies of shared KV blocks"),
    "kv_blocks_saved_by_sharing": Series("pagedserve:kv_blocks_saved_by_sharing", False, sum,
                                         "block-table entries served by a shared block (logical - physical)"),
    "kv_tier_hit_tokens_total": Series("pagedserve:kv_tier_hit_tokens", True, sum,
                                       "prompt tokens whose KV was copied up from the host or disk tier"),
    "kv_tier_demotions_total": Series("pagedserve:kv_tier_demotions", True, sum, "evicted KV blocks kept in the host tier"),
    "kv_tier_spills_total": Series("pagedserve:kv_tier_spills", True, sum, "KV blocks written to the disk tier"),
    "kv_tier_host_hits_total": Series("pagedserve:kv_tier_host_hits", True, sum, "KV blocks promoted from the host tier"),
    "kv_tier_disk_hits_total": Series("pagedserve:kv_tier_disk_hits", True, sum, "KV blocks loaded from the disk tier"),
    "kv_tier_host_blocks": Series("pagedserve:kv_tier_host_blocks", False, sum, "KV blocks held in the host tier"),
    "kv_tier_disk_bytes": Series("pagedserve:kv_tier_disk_bytes", False, sum, "bytes of KV blocks in the disk tier"),
    "kv_tier_disk_corrupt_total": Series("pagedserve:kv_tier_disk_corrupt", True, sum,
                                         "disk-tier files that failed verification (deleted, recomputed)"),
    "kv_tier_disk_skipped_total": Series("pagedserve:kv_tier_disk_skipped", True, sum,
                                         "spills not written: the disk tier's writer was too far behind"),
    "kv_tier_copy_up_seconds_total": Series("pagedserve:kv_tier_copy_up_seconds", True, sum,
                                            "seconds spent copying host-tier and disk-tier blocks up to the device"),
    "kv_tier_disk_read_seconds_total": Series("pagedserve:kv_tier_disk_read_seconds", True, sum,
                                              "seconds spent reading and verifying disk-tier blocks"),
    "spec_decode_num_drafts_total": Series("pagedserve:spec_decode_num_drafts", True, sum,
                                           "decode rows that carried speculative drafts"),
    "spec_decode_num_draft_tokens_total": Series("pagedserve:spec_decode_num_draft_tokens", True, sum,
                                                 "tokens drafted by speculative decoding"),
    "spec_decode_num_accepted_tokens_total": Series("pagedserve:spec_decode_num_accepted_tokens", True, sum,
                                                    "drafted tokens the model accepted"),
    "queue_depth": Series("pagedserve:queue_depth", False, max, "entries in the model's request stream"),
    "dead_letters": Series("pagedserve:dead_letters", False, max, "entries in the model's dead-letter stream"),
    "in_flight": Series("pagedserve:requests_in_flight", False, sum, "requests a worker holds"),
    "generation_tokens_per_s": Series("pagedserve:generation_tokens_per_s", False, sum, "tokens sent per second, recently"),
}


HISTOGRAMS = {  # the key's stem a worker stores in Redis -> (exported name, help)
    "engine_step_seconds": ("pagedserve:engine_step_seconds",
                            "seconds each engine step took: how long every running stream waited for its next token"),
}


def is_worker_key(key: str) -> bool:
    """Whether a worker's number of this key is exported (a series, or a histogram's part)."""
    return key in WORKER_SERIES or any(key.startswith(stem + "_") for stem in HISTOGRAMS)


def combine(key: str, values: Iterable[float]) -> float:
    """The workers' values of ``key`` as one (a histogram's parts are summed)."""
    series = WORKER_SERIES.get(key)
    return series.combine(values) if series is not None else sum(values)


def bucket_keys(values: dict[str, float], stem: str) -> list[tuple[float, str]]:
    """(bound, key) of a flat histogram's buckets (``{stem}_le_{bound}``) in ``values``, lowest first."""
    return sorted((float(key[len(stem) + 4:]), key) for key in values if key.startswith(stem + "_le_"))


def histogram_families(values: dict[str, float], model: str) -> Iterator[Metric]:
    for stem, (name, help_text) in HISTOGRAMS.items():
        bounds = [(bound, values[key]) for bound, key in bucket_keys(values, stem)]
        if not bounds or stem + "_count" not in values:
            continue
        family = HistogramMetricFamily(name, help_text, labels=["model_name"])
        family.add_metric([model], [(f"{bound:g}", count) for bound, count in bounds] + [("+Inf", values[stem + "_count"])],
                          sum_value=values.get(stem + "_sum", 0.0))
        yield family


def families(values: dict[str, float], model: str) -> Iterator[Metric]:
    """One metric family per known value, labelled with the model; unknown keys are skipped."""
    yield from histogram_families(values, model)
    for key, value in values.items():
        series = WORKER_SERIES.get(key)
        if series is None:
            continue
        kind = CounterMetricFamily if series.counter else GaugeMetricFamily
        family = kind(series.name, series.help, labels=["model_name"])
        family.add_metric([model], value)
        yield family


def cache_config_info(model: str, limits: dict) -> Metric:
    """vLLM's ``vllm:cache_config_info``: a gauge of 1 whose labels say how the worker's KV cache
    is laid out (``Engine.limits()``: block size, the format of ``--kv-cache-dtype``, its bytes per token)."""
    labels = {"model_name": model, "block_size": str(limits["block_size"]), "cache_dtype": str(limits["kv_cache_dtype"]),
              "kv_bytes_per_token": str(limits["kv_bytes_per_token"])}
    family = GaugeMetricFamily("vllm:cache_config_info", "how the KV cache is laid out", labels=list(labels))
    family.add_metric(list(labels.values()), 1.0)
    return family


class SnapshotCollector:
    """A prometheus_client collector reporting the last values it was given (and, with ``limits``,
    the cache's layout)."""

    def __init__(self, model: str, limits: dict | None = None) -> None:
        self.model, self.limits = model, limits
        self.values: dict[str, float] = {}

    def collect(self) -> Iterator[Metric]:
        if self.limits is not None:
            yield cache_config_info(self.model, self.limits)
        yield from families(self.values, self.model)
