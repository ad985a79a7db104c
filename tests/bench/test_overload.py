"""The overload scenario's CI variant (``bench/overload.py`` with a depth of 6, one worker): ten
times what the gateway admits, in one burst. It fails if the model's streams ever held more than
the depth, a refusal was not a 429 with Retry-After, a refused request reached a stream, any
request failed or outlived its deadline, or the queue did not drain."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_a_burst_of_ten_times_the_queue_is_refused_early_and_the_rest_served():
    done = subprocess.run([sys.executable, "-m", "pagedserve.bench.overload", "--depth", "6", "--times", "10",
                           "--workers", "1", "--max-num-seqs", "4", "--max-tokens", "16", "--probes", "2",
                           "--timeout", "60"], capture_output=True, text=True, timeout=420)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith('{"bench": "overload"')), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(line)
    assert result["passed"] and done.returncode == 0, result
    assert result["burst"] == 60 and result["admitted"] >= 6 and result["refused"] >= 30
    assert result["entries_added"] == result["admitted"]
