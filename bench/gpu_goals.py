"""Issue #63's goals read from a device run's ``results.json`` (``bench/gpu_check.sh``): each goal's
figure, its bar and whether it is met, as a JSON line and a table; a goal the run did not measure says
so (``met``: null) instead of passing or failing. ``gpu_check.sh`` runs it last, so the fifteen minutes
a session gets on a device end with the verdicts, not with JSON to read by hand.

    python -m pagedserve.bench.gpu_goals out/results.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pagedserve.bench.table import print_table

FIRST_RUN_RATIO = 6.6  # offline llama-1b bf16 with graphs over transformers, the first device run (H200, 4,467 tok/s)


def step_result(results: dict, step: str) -> dict:
    """A step's JSON: the file as written, or the line naming a bench where the step tee'd a table too."""
    value = results.get(step)
    if isinstance(value, list):
        return next((row for row in value if isinstance(row, dict) and "bench" in row), {})
    return value if isinstance(value, dict) else {}


def goals(results: dict) -> list[dict]:
    """Every goal of #63 against the run's figures (``met``: None where the run lacks the figure)."""
    rows: list[dict] = []

    def goal(name: str, figure: float | None, bar: float) -> None:
        rows.append({"goal": name, "figure": figure, "bar": bar, "met": None if figure is None else figure >= bar})

    kernel = step_result(results, "kernel_bench")
    prefill = [r["kernel_vs_sdpa"] for r in kernel.get("prefill", []) if 512 <= r["length"] <= 8192]
    goal("prefill vs SDPA's flash kernel, 512-8k tokens (the worst)", min(prefill, default=None), 0.7)
    for step, heads in (("kv_decode", ""), ("kv_decode_llama", ", Llama-3-8B heads")):  # SmolLM2's heads, then 32/8 x 128
        kv = step_result(results, step).get("results", [])
        for name, label in (("int8", "int8"), ("fp8", "fp8"), ("int8_products", "int8 with --quantized-products"),
                            ("fp8_products", "fp8 with --quantized-products")):
            for shortest, bar in ((1024, 1.0), (8192, 1.5)):
                speedups = [r[f"{name}_speedup"] for r in kv if r["context"] >= shortest and f"{name}_speedup" in r]
                goal(f"{label} cache decode over bf16 at >= {shortest} tokens{heads} (the worst)",
                     min(speedups, default=None), bar)
    decode = {(r["batch"], r["context"]): r for r in kernel.get("results", [])}
    for (batch, context), bar in (((1, 32768), 0.6), ((128, 16384), 0.85)):
        goal(f"{batch} x {context} decode, fraction of copy bandwidth",
             decode.get((batch, context), {}).get("fraction_of_copy_bw"), bar)
    graphs = step_result(results, "offline_throughput_graphs")
    off, base = (tokens_per_s(graphs, row) for row in (0, 1))  # pagedserve's row, then transformers'
    ahead = tokens_per_s(step_result(results, "offline_throughput_async"))
    goal(f"offline llama-1b bf16, graphs and async scheduling, over transformers (first run {FIRST_RUN_RATIO}x)",
         ratio(ahead, base), round(1.2 * FIRST_RUN_RATIO, 2))
    goal("async scheduling over one step at a time, graphs", ratio(ahead, off), 1.0)
    lora = [r["vs_off"] for r in step_result(results, "lora").get("results", []) if r.get("adapters")]
    goal("LoRA on over off, graphs (the worst spread)", min(lora, default=None), 0.85)
    on = tokens_per_s(step_result(results, "offline_throughput_ngram"))
    goal("n-gram drafts over none, copy-heavy, graphs", ratio(on, off), 1.5)
    return rows


def tokens_per_s(step: dict, row: int = 0) -> float | None:
    """An offline_throughput step's tok/s: its first engine's (pagedserve), or ``row``'s."""
    rows = step.get("results", [])
    return rows[row].get("tokens_per_s") if len(rows) > row else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return round(numerator / denominator, 2) if numerator and denominator else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, help="gpu_check.sh's results.json")
    args = ap.parse_args(argv)
    rows = goals(json.loads(args.results.read_text()))
    print(json.dumps({"bench": "gpu_goals", "goals": rows,
                      "met": sum(r["met"] is True for r in rows), "missed": sum(r["met"] is False for r in rows),
                      "not_measured": sum(r["met"] is None for r in rows)}))
    print_table(rows, [("goal", lambda r: r["goal"]), ("figure", lambda r: "-" if r["figure"] is None else r["figure"]),
                       ("bar", lambda r: r["bar"]),
                       ("met", lambda r: {True: "yes", False: "NO", None: "not measured"}[r["met"]])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
