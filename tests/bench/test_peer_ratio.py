"""The peer comparison reads the right lines and builds the peers' workload."""

import json

from pagedserve.bench.peer_ratio import peer_lines, w64


def test_w64_is_the_peers_workload():
    work = w64(16384)
    assert len(work) == 64 and work == w64(16384)  # seeded: the same every time
    assert all(32 <= len(p) <= 256 and 32 <= n <= 256 and all(4 <= t < 16384 for t in p) for p, n in work)
    assert sum(n for _, n in work) == 9521  # the output tokens bench_vllm.py reports for W64


def test_peer_lines_keep_the_newest_per_engine_for_this_model_and_dtype(tmp_path):
    path = tmp_path / "results.jsonl"
    lines = [
        {"engine": "vllm-cpu", "mode": "LLM.generate", "model": "llama-med", "dtype": "bfloat16", "out_tok_s": 1},
        {"engine": "vllm-cpu", "mode": "LLM.generate", "model": "llama-med", "dtype": "bfloat16", "out_tok_s": 2},
        {"engine": "vllm-cpu", "mode": "LLM.generate", "model": "llama-med", "dtype": "float32", "out_tok_s": 3},
        {"engine": "hf", "mode": "static", "model": "llama-med", "dtype": "bf16", "out_tok_s": 4},
        {"engine": "hf", "mode": "static", "model": "llama-tiny", "dtype": "bf16", "out_tok_s": 5},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\nnot json\n")
    assert sorted(r["out_tok_s"] for r in peer_lines(path, "llama-med", "bfloat16")) == [2, 4]
    assert peer_lines(tmp_path / "missing.jsonl", "llama-med", "bfloat16") == []
