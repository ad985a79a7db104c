"""The Redis-gone scenario's CI variant (``bench/redis_gone.py``: 4 streams, Redis SIGKILLed and left
down, a 3 s outage grace, a 5 s drain timeout). It fails if a stream hung or ended otherwise than
with the Redis error within the grace and 10 s, if a new request was not a 503, or if the stop took
longer than the drain timeout and 10 s or a child had to be killed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_streams_end_with_the_redis_error_and_the_stack_stops_on_time_with_redis_gone():
    done = subprocess.run([sys.executable, "-m", "pagedserve.bench.redis_gone", "--requests", "4", "--max-tokens", "1000",
                           "--grace", "3", "--drain", "5", "--deadline", "60"], capture_output=True, text=True, timeout=300)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith('{"bench": "redis_gone"')), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(line)
    assert result["passed"] and done.returncode == 0, result
