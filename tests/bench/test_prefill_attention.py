"""``bench/prefill_attention.py`` runs at a small size and says what it measured: one JSON line with
a row per length, then the table."""

from __future__ import annotations

import json

from pagedserve.bench.prefill_attention import main


def test_the_prefill_bench_prints_a_json_line_and_a_table(capsys):
    assert main(["--lengths", "48", "80", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    result = json.loads(lines[0])
    assert result["bench"] == "prefill_attention" and [r["tokens"] for r in result["results"]] == [48, 80]
    assert all(r[key] > 0 for r in result["results"] for key in ("native_ms", "torch_ms", "flash_contiguous_ms"))
    assert lines[1].split() == ["tokens", "native_ms", "torch_ms", "flash_contiguous_ms"] and len(lines) == 4
