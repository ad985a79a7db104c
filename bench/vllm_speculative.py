"""vLLM's speculative decoding on the same workloads as ``bench/speculative.py``, in the same sitting:
run it with vLLM's Python (``$PEERS/vllm/bin/python``, ``../shared/peers/setup.sh vllm``) on the
workloads that script dumps (``--dump-prompts``: token ids, so both engines see the same prompts)
and a model directory vLLM reads (safetensors). One stream: each request alone, decode tokens/s
after its first token (its time with ``max_tokens=1`` taken off); at once: output tokens/s over the
wall time. Prints a JSON line per workload and configuration, then a table.

    VLLM_CPU_KVCACHE_SPACE=2 $PEERS/vllm/bin/python bench/vllm_speculative.py --model DIR --workloads FILE [--k 6] [--only NAME]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path


def timed(llm, prompts, params) -> tuple[float, list[list[int]]]:
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    done = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - started, [list(o.outputs[0].token_ids) for o in done]


def run(llm, workload: dict) -> dict:
    from vllm import SamplingParams

    # No seeds: vLLM-cpu 0.32 fails a seeded request whose prompt is prefilled in chunks ("CPU Generator does
    # not use offset", gpu_model_runner._bookkeeping_sync), so its sampled rows draw unseeded.
    params = [SamplingParams(temperature=p["temperature"], max_tokens=p["max_tokens"], ignore_eos=p.get("ignore_eos", True))
              for p in workload["params"]]
    if workload["at_once"]:
        seconds, outputs = timed(llm, workload["prompts"], params)
        return {"tokens_per_s": sum(map(len, outputs)) / seconds, "outputs": outputs}
    decode_tokens, decode_seconds, outputs = 0, 0.0, []
    for prompt, p in zip(workload["prompts"], params):
        first, _ = timed(llm, [prompt], [SamplingParams(temperature=p.temperature, max_tokens=1)])
        seconds, (tokens,) = timed(llm, [prompt], [p])
        decode_tokens, decode_seconds = decode_tokens + len(tokens) - 1, decode_seconds + seconds - first
        outputs.append(tokens)
    return {"tokens_per_s": decode_tokens / decode_seconds, "outputs": outputs}


def main() -> None:
    from vllm import LLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model directory vLLM reads")
    parser.add_argument("--workloads", type=Path, required=True, help="bench/speculative.py --dump-prompts' file")
    parser.add_argument("--k", type=int, default=6)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--only", help="run only the workloads whose name contains this")
    args = parser.parse_args()
    workloads = [w for w in json.loads(args.workloads.read_text()) if not args.only or args.only in w["workload"]]
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min}
    rows = []
    for label, speculative in (("off", None), (f"ngram k={args.k}", spec)):
        llm = LLM(model=args.model, dtype="float32", max_model_len=2048, seed=0, speculative_config=speculative)
        for workload in workloads:
            result = run(llm, workload)
            rows.append({"bench": "vllm_speculative", "config": label, "workload": workload["workload"], **result})
            print(f"{label}, {workload['workload']}: {result['tokens_per_s']:.1f} tok/s", flush=True)
        del llm
    for row in rows:
        base = next(r for r in rows if r["workload"] == row["workload"] and r["config"] == "off")
        row["speedup"], row["same_tokens"] = row["tokens_per_s"] / base["tokens_per_s"], row["outputs"] == base["outputs"]
        print(json.dumps({k: v for k, v in row.items() if k != "outputs"}))
    table = importlib.util.spec_from_file_location("table", Path(__file__).with_name("table.py"))
    module = importlib.util.module_from_spec(table)
    table.loader.exec_module(module)  # vLLM's Python has no pagedserve: the table printer by its path
    module.print_table(rows, [("workload", lambda r: r["workload"]), ("speculation", lambda r: r["config"]),
                              ("tok/s", lambda r: f"{r['tokens_per_s']:.1f}"), ("vs off", lambda r: f"{r['speedup']:.2f}x"),
                              ("same tokens", lambda r: "yes" if r["same_tokens"] else "NO")])


if __name__ == "__main__":
    main()
