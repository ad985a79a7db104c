"""The Redis Cluster failover scenario's CI variant (``bench/cluster_failover.py``: three masters
with a replica each, the master holding the model's slot SIGKILLed under 8 greedy streams). It
fails if a stream did not complete with the clean pass's text, the replica never took over, or a
worker or the gateway did not survive the failover."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_a_master_killed_under_streams_fails_over_and_every_stream_completes():
    done = subprocess.run([sys.executable, "-m", "pagedserve.bench.cluster_failover", "--requests", "8",
                           "--max-tokens", "120", "--deadline", "120"], capture_output=True, text=True, timeout=420)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith('{"bench": "cluster_failover"')), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(line)
    assert result["passed"] and done.returncode == 0, result
    assert result["failover_s"] is not None and result["completed"] == 8, result
