"""The worker's periodic stats line: rates over the interval, quiet when idle or before its time."""

from pagedserve.worker.core.scheduling.step_time import StepSeconds
from pagedserve.worker.serve.stats_log import StatsLine


def test_the_stats_line_reports_rates_since_the_last_line_and_stays_quiet_when_idle():
    now = [0.0]
    line = StatsLine(10.0, clock=lambda: now[0])
    busy = {"prefix_cache_queries_total": 500, "prefix_cache_hits_total": 100, "generation_tokens_total": 2000,
            "num_requests_running": 8, "num_requests_waiting": 2, "kv_cache_usage_perc": 0.25, "num_preemptions_total": 1}
    now[0] = 5.0
    assert line.due(busy) is None  # not yet
    now[0] = 10.0
    assert line.due(busy) == {"prompt_tok_s": 50.0, "generation_tok_s": 200.0, "running": 8, "waiting": 2,
                              "kv_usage_pct": 25.0, "prefix_hit_pct": 20.0, "preemptions": 1, "step_ms_p99": None}
    now[0] = 20.0
    idle = {**busy, "num_requests_running": 0, "num_requests_waiting": 0}
    assert line.due(idle) is None  # nothing ran since the last line
    assert StatsLine(0.0, clock=lambda: 100.0).due(busy) is None  # 0: off


def test_the_stats_line_says_the_p99_of_the_steps_since_the_last_line():
    """98 steps of 20 ms and 2 of 300 ms (a long prompt's chunks beside the streams): the p99 falls
    in the 500 ms bucket; the next interval's steps alone (all quick) in the 25 ms one."""
    now, steps = [0.0], StepSeconds()
    line = StatsLine(10.0, clock=lambda: now[0])
    now[0] = 10.0
    for seconds in [0.02] * 98 + [0.3] * 2:
        steps.observe(seconds)
    busy = {"num_requests_running": 8, **steps.snapshot()}
    assert busy["engine_step_seconds_count"] == 100 and busy["engine_step_seconds_le_0.25"] == 98
    assert abs(busy["engine_step_seconds_sum"] - (98 * 0.02 + 2 * 0.3)) < 1e-9
    assert line.due(busy)["step_ms_p99"] == 500.0
    for _ in range(50):
        steps.observe(0.02)
    now[0] = 20.0
    assert line.due({"num_requests_running": 8, **steps.snapshot()})["step_ms_p99"] == 25.0
