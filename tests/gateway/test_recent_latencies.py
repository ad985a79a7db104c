"""The dashboard's last-minute latencies: percentiles over a window, and memory bounded by time
even when no chart ever asks (the soak's gateway held 20,000 samples of each kind)."""

from pagedserve.gateway.dashboard.recent_latencies import RecentLatencies


def test_samples_older_than_a_minute_are_dropped_as_new_ones_come():
    recent = RecentLatencies(keep_s=60.0)
    for i in range(1000):
        recent.add("itl", 0.01, now=i * 0.05)  # 50 s of samples
    assert recent.kept("itl") == 1000
    recent.add("itl", 0.02, now=200.0)  # no chart asked in between
    assert recent.kept("itl") == 1 and recent.kept("ttft") == 0


def test_percentiles_cover_the_window_only():
    recent = RecentLatencies()
    for i in range(100):
        recent.add("ttft", (i + 1) / 1000, now=100.0 + i * 0.01)
    recent.add("ttft", 9.0, now=80.0)  # older than the 10 s window, younger than a minute
    got = recent.percentiles("ttft", window_s=10.0, now=101.0)
    assert got == {"count": 100, "p50": 51.0, "p90": 91.0, "p99": 100.0, "max": 100.0}


def test_the_longest_gap_shows_a_stall_that_the_percentiles_hide():
    """Eight streams' gaps for ten seconds, and one step that paused them all for two seconds: eight
    samples in thousands, below p99, which only the longest gap shows (issue #64's stall)."""
    recent = RecentLatencies()
    for i in range(4000):
        recent.add("itl", 0.02, now=100.0 + i * 0.0025)
    for _ in range(8):
        recent.add("itl", 2.0, now=105.0)
    got = recent.percentiles("itl", window_s=10.0, now=110.0)
    assert got["p99"] == 20.0 and got["max"] == 2000.0
