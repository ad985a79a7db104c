"""The worker's periodic stats line: rates over the interval, quiet when idle or before its time."""

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
                              "kv_usage_pct": 25.0, "prefix_hit_pct": 20.0, "preemptions": 1}
    now[0] = 20.0
    idle = {**busy, "num_requests_running": 0, "num_requests_waiting": 0}
    assert line.due(idle) is None  # nothing ran since the last line
    assert StatsLine(0.0, clock=lambda: 100.0).due(busy) is None  # 0: off
