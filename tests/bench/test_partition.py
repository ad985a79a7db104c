"""The partition scenario's CI variant (``bench/partition.py``: one of two workers cut off from
Redis for 6 s under 8 greedy streams, heartbeats of 0.5 s). It fails if a stream did not complete
with its reference text, the cut worker held nothing when cut (the scenario did not happen), did
not come back beating or serving without a restart, or sent the events of requests taken over
from it once Redis was back instead of dropping them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_a_worker_cut_off_from_redis_comes_back_and_nothing_reaches_a_client_twice():
    done = subprocess.run([sys.executable, "-m", "pagedserve.bench.partition", "--requests", "8", "--cut-s", "6",
                           "--max-tokens", "120", "--heartbeat", "0.5", "--deadline", "120"],
                          capture_output=True, text=True, timeout=420)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith('{"bench": "partition"')), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(line)
    assert result["passed"] and done.returncode == 0, result
    assert result["dropped_by_the_cut_worker"] >= 1, result  # it checked what it still held before sending
