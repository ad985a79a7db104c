"""The soak's CI variant (``bench/soak.py --minutes 3``): three minutes of mixed traffic against two
workers that preempt and swap all the time, with idle points; it fails if any request failed, a KV
block stayed held or the queue stayed full at an idle point, or descriptors or Redis keys grew."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_three_minutes_of_mixed_traffic_leave_nothing_behind():
    done = subprocess.run([sys.executable, "-m", "pagedserve.bench.soak", "--minutes", "3", "--idle-every", "40",
                           "--sample-s", "5"], capture_output=True, text=True, timeout=480)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith('{"bench": "soak"')), None)
    assert line is not None, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(line)
    assert result["passed"] and done.returncode == 0, {k: result[k] for k in ("checks", "requests", "failures", "unclean_idle")}
    kinds = {key.split(":")[0] for key in result["requests"] if ":" in key}
    assert {"chat_stream", "completion_n", "beam", "structured", "tools", "responses", "messages", "disconnect",
            "deadline", "cancel"} <= kinds  # every kind of traffic ran
    assert result["idle_points"] >= 4 and result["requests"]["ok"] > 100
