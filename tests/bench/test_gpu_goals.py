"""bench/gpu_goals.py over a results.json shaped as gpu_check.sh writes it (the kernel benchmark's file,
kv_decode's and lora's tee'd lines, offline_throughput's --out files): each goal's figure is the worst
of the rows it covers, a goal the run lacks is not measured rather than met or missed, and the
n-gram goal is the ratio of two steps of the same run."""

from __future__ import annotations

import json

from pagedserve.bench.gpu_goals import goals, main


def run_results() -> dict:
    decode = [{"batch": b, "context": c, "fraction_of_copy_bw": f} for b, c, f in
              [(1, 1024, 0.2), (1, 32768, 0.64), (128, 16384, 0.84)]]
    prefill = [{"length": n, "kernel_vs_sdpa": r} for n, r in [(512, 0.9), (2048, 0.72), (8192, 0.8)]]
    kv = [{"context": c, "int8_speedup": i, "fp8_speedup": f, "int8_products_speedup": ip, "fp8_products_speedup": fp}
          for c, i, f, ip, fp in [(64, 0.5, 0.5, 0.3, 0.4), (1024, 1.1, 0.95, 1.2, 1.05), (8192, 1.6, 1.7, 1.5, 1.4)]]
    offline = lambda *tok_s: {"bench": "offline_throughput", "results": [{"tokens_per_s": t} for t in tok_s]}  # noqa: E731
    return {"kernel_bench": {"bench": "kernel_decode", "results": decode, "prefill": prefill},
            "kv_decode": [{"bench": "kv_decode", "results": kv}, {"context": "a table line"}],
            "kv_decode_llama": [{"bench": "kv_decode", "results": [{**row, "int8_products_speedup": 2.0} for row in kv]}],
            "lora": [{"bench": "lora", "results": [{"adapters": 0, "vs_off": 1.0}, {"adapters": 1, "vs_off": 0.9},
                                                   {"adapters": 8, "vs_off": 0.86}]}],
            "offline_throughput_graphs": offline(5000.0, 625.0), "offline_throughput_ngram": offline(8000.0),
            "offline_throughput_async": offline(5500.0)}


def test_each_goal_is_the_worst_of_its_rows_against_its_bar():
    met = {row["goal"]: (row["figure"], row["met"]) for row in goals(run_results())}
    assert met["prefill vs SDPA's flash kernel, 512-8k tokens (the worst)"] == (0.72, True)
    assert met["int8 cache decode over bf16 at >= 1024 tokens (the worst)"] == (1.1, True)  # 64 tokens left out
    assert met["fp8 cache decode over bf16 at >= 1024 tokens (the worst)"] == (0.95, False)
    assert met["int8 cache decode over bf16 at >= 8192 tokens (the worst)"] == (1.6, True)
    assert met["fp8 with --quantized-products cache decode over bf16 at >= 1024 tokens (the worst)"] == (1.05, True)
    assert met["fp8 with --quantized-products cache decode over bf16 at >= 8192 tokens (the worst)"] == (1.4, False)
    assert met["int8 with --quantized-products cache decode over bf16 at >= 8192 tokens (the worst)"] == (1.5, True)
    llama = "int8 with --quantized-products cache decode over bf16 at >= 1024 tokens, Llama-3-8B heads (the worst)"
    assert met[llama] == (2.0, True)  # the second shape's step read on its own
    assert met["1 x 32768 decode, fraction of copy bandwidth"] == (0.64, True)
    assert met["128 x 16384 decode, fraction of copy bandwidth"] == (0.84, False)
    assert met["LoRA on over off, graphs (the worst spread)"] == (0.86, True)  # the base rows' 1.0 left out
    assert met["n-gram drafts over none, copy-heavy, graphs"] == (1.6, True)
    offline = next(v for k, v in met.items() if k.startswith("offline llama-1b"))
    assert offline == (8.8, True)  # async over the graphs step's transformers; the bar: 1.2 x the first run's 6.6
    assert met["async scheduling over one step at a time, graphs"] == (1.1, True)


def test_a_step_the_run_lacks_is_not_measured(tmp_path, capsys):
    results = run_results()
    del results["offline_throughput_graphs"], results["kv_decode"]
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert main([str(path)]) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[0])
    unmeasured = {row["goal"] for row in line["goals"] if row["met"] is None}
    # 8 cache goals (int8, fp8, each with and without quantized products) at SmolLM2's heads (the Llama shape's
    # step is there), and those over the graphs step's figures: async's two, n-gram's
    assert len(unmeasured) == 11 and line["not_measured"] == 11
    assert all(row["figure"] is None for row in line["goals"] if row["goal"] in unmeasured)
