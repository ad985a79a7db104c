"""``bench/tensor_parallel.py`` end to end on a test model: every row runs, TP=2 reports its collectives."""

from __future__ import annotations

import json

from pagedserve.bench import tensor_parallel


def test_the_tensor_parallel_bench_runs_every_row(zoo, capsys):
    assert tensor_parallel.main(["--model-dir", str(zoo.path("llama-gqa")), "--batch", "4", "--prompt-len", "8",
                                 "--max-tokens", "4", "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[0])
    assert [(r["config"], r["batch"]) for r in result["results"]] == [
        ("TP=1", 1), ("TP=1", 4), ("TP=1, no C decode stack", 1), ("TP=1, no C decode stack", 4), ("TP=2", 1), ("TP=2", 4)]
    assert all(r["tokens"] == r["batch"] * 4 for r in result["results"])
    tp2 = [r for r in result["results"] if r["config"] == "TP=2"]
    assert all(0 < r["all_reduce_share"] <= r["collective_share"] < 1 for r in tp2)
