"""``bench/lora.py`` end to end on a test model: its random PEFT directories load, every row runs."""

from __future__ import annotations

import json

from pagedserve.bench import lora


def test_the_lora_bench_runs_every_spread(zoo, capsys):
    assert lora.main(["--model", str(zoo.path("llama-gqa")), "--batch", "8", "--prompt-len", "8", "--max-tokens", "4",
                      "--repeats", "1", "--rank", "8"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[0])
    assert [r["adapters"] for r in result["results"]] == [0, 0, 1, 4, 8]
    assert all(r["tokens"] == 8 * 4 for r in result["results"])
