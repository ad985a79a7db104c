"""``worker/serve/self_report.py`` and ``worker/serve/metrics.py`` on their own, with the real engine
on a small model and no Redis: the metrics a worker stores and exports (the engine's snapshot with
what its I/O side queued, holds and sent, and the token rate since the last reading), the
``WorkerInfo`` gateways route by, the dashboard's figures, and its Prometheus endpoint serving the
last values with vLLM's names and the cache's layout."""

from __future__ import annotations

import asyncio
import socket
import time
import urllib.request

import pytest

from pagedserve.shared.protocol import ReplyTarget, WireRequest
from pagedserve.shared.sampling import SamplingParams
from pagedserve.shared.worker_info import WorkerInfo
from pagedserve.worker.engine import Engine
from pagedserve.worker.serve.events import InFlight
from pagedserve.worker.serve.inflight import InFlightTable
from pagedserve.worker.serve.loop import EngineLoop
from pagedserve.worker.serve.metrics import WorkerMetrics, worker_metrics
from pagedserve.worker.serve.self_report import SelfReport
from pagedserve.worker.setup.engine_config import EngineConfig


@pytest.fixture(scope="module")
def engine(zoo):
    return Engine(EngineConfig(model=str(zoo.path("llama-gqa")), device="cpu", dtype="float32", num_gpu_blocks=32,
                               block_size=8, max_model_len=128, max_num_seqs=4))


def request(request_id: str) -> WireRequest:
    return WireRequest(request_id, "m", SamplingParams(max_tokens=4), ReplyTarget("channel", "r"), prompt_token_ids=[5, 6])


def test_the_metrics_are_the_engine_s_with_what_the_io_side_queued_holds_and_sent(engine):
    loop = EngineLoop(engine, lambda outputs, errors: None)
    loop.snapshot = {**loop.snapshot, "num_requests_waiting": 2, "num_requests_running": 3}
    inflight = InFlightTable(8, 8, str)
    for request_id in ("a", "b"):
        inflight.add(InFlight(f"e-{request_id}", request(request_id)))
    loop.add(request("a"), [5, 6])  # in the engine's inbox, not taken yet: waiting too
    report = SelfReport("w1", "m", engine.limits(), inflight, loop, asyncio.Event())
    first = report.metrics()
    assert {k: first[k] for k in ("num_requests_waiting", "num_requests_running", "in_flight", "generation_tokens_total")} \
        == {"num_requests_waiting": 3, "num_requests_running": 3, "in_flight": 2, "generation_tokens_total": 0}
    assert first["generation_tokens_per_s"] == 0  # nothing sent since the start
    assert first["kv_cache_usage_perc"] == engine.stats()["kv_cache_usage_perc"]  # the engine's own, passed on
    inflight.tokens_out = 30
    time.sleep(0.2)
    second = report.metrics()
    assert second["generation_tokens_total"] == 30
    assert 30 / 0.6 < second["generation_tokens_per_s"] <= 30 / 0.2  # since the last reading, not since start
    assert report.metrics()["generation_tokens_per_s"] < 30  # nothing sent since: the rate falls back
    assert worker_metrics({"x": 1.0}, 0, 0, 0, 2.345) == {"x": 1.0, "num_requests_waiting": 0, "in_flight": 0,
                                                         "generation_tokens_total": 0, "generation_tokens_per_s": 2.35}


def test_the_worker_info_and_dashboard_figures_say_its_limits_load_and_whether_it_drains(engine):
    loop = EngineLoop(engine, lambda outputs, errors: None)
    inflight = InFlightTable(8, 8, str)
    inflight.add(InFlight("e-a", request("a")))
    inflight.tokens_out = 7
    stopping = asyncio.Event()
    report = SelfReport("w1", "m", engine.limits(), inflight, loop, stopping)
    assert report.dashboard_figures()["queue_depth"] == 0  # until the first upkeep reads the stream
    report.queue_depth = 5
    info = report.worker_info({"num_requests_running": 2.0, "num_requests_waiting": 1.0})
    assert info == WorkerInfo("w1", "m", **engine.limits(), running=2, waiting=1, draining=False)
    assert report.worker_info({}) == WorkerInfo("w1", "m", **engine.limits())
    assert report.dashboard_figures() == {"tokens_out": 7, "in_flight": 1, "queue_depth": 5, "draining": False}
    stopping.set()
    assert report.worker_info({}).draining and report.dashboard_figures()["draining"]


def test_the_prometheus_endpoint_serves_the_last_values_and_the_cache_layout_on_its_address_only(engine):
    with socket.socket() as s:
        s.bind(("127.0.0.2", 0))
        port = s.getsockname()[1]
    exported = WorkerMetrics(port, "m", host="127.0.0.2", limits=engine.limits())
    with pytest.raises(OSError):  # bound to the address it was given, not to every interface
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
    exported.update({"num_requests_running": 3.0, "in_flight": 4.0, "not_a_series": 9.0})
    exported.update({"num_requests_running": 1.0, "in_flight": 4.0})  # the last values replace the earlier ones
    page = urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=10).read().decode()
    assert 'vllm:num_requests_running{model_name="m"} 1.0' in page
    assert 'pagedserve:requests_in_flight{model_name="m"} 4.0' in page
    assert "not_a_series" not in page
    assert 'cache_dtype="auto"' in page and 'vllm:cache_config_info{' in page
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    WorkerMetrics(port, "m")  # by default on the loopback address
    assert urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).status == 200
