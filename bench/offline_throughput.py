"""Offline throughput: pagedserve ``LLM.generate`` vs transformers ``generate`` with static batches.

Same model, same prompts, same output lengths (EOS ignored), same process, one after the other.
The baseline pads each batch of ``--hf-batch`` prompts on the left and runs it until its longest
output is done, which is what static batching does; both count only the requested tokens.

    python bench/offline_throughput.py [--requests 128] [--dtype float32] [--hf-batch 32]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from shared.sampling import SamplingParams
from shared.demo_model import build_model

MODEL = dict(hidden_size=768, num_layers=14, num_heads=12, num_kv_heads=4, intermediate_size=2048, vocab_size=512)


def workload(seed: int, count: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randint(10, vocab - 1) for _ in range(rng.randint(32, 512))], rng.randint(32, 256))
        for _ in range(count)
    ]


def run_pagedserve(path: Path, work, dtype: str, kv_bytes: int, max_batched: int) -> dict:
    from pagedserve import LLM

    llm = LLM(path, dtype=dtype, kv_cache_memory=kv_bytes, max_num_batched_tokens=max_batched, max_num_seqs=256)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=True)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"engine": "pagedserve", "seconds": round(seconds, 2), "output_tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1), "preemptions": llm.engine.scheduler.stats.num_preemptions}


def run_transformers(path: Path, work, dtype: str, batch: int) -> dict:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    pad = model.config.pad_token_id
    start = time.perf_counter()
    tokens = 0
    for i in tqdm(range(0, len(work), batch), desc="transformers batches"):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk])
        longest = max(n for _, n in chunk)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad)
        tokens += sum(n for _, n in chunk)  # what was asked for; the padding steps are waste
    seconds = time.perf_counter() - start
    return {"engine": f"transformers static batch={batch}", "seconds": round(seconds, 2), "output_tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--kv-cache-memory", type=int, default=3 << 30, help="bytes")
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--model-dir", type=Path, default=Path.home() / ".cache" / "pagedserve" / "bench-llama-90m")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if not (args.model_dir / "config.json").exists():
        build_model(args.model_dir, "llama", **MODEL, seed=0)
    work = workload(args.seed, args.requests, MODEL["vocab_size"])
    ours = run_pagedserve(args.model_dir, work, args.dtype, args.kv_cache_memory, args.max_num_batched_tokens)
    base = run_transformers(args.model_dir, work, args.dtype, args.hf_batch)
    result = {
        "bench": "offline_throughput", "requests": args.requests, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "model": MODEL, "results": [ours, base], "ratio": round(ours["tokens_per_s"] / base["tokens_per_s"], 2),
    }
    print(json.dumps(result))
    print(f"{'engine':<36} {'seconds':>8} {'out tokens':>10} {'tok/s':>8}")
    for r in (ours, base):
        print(f"{r['engine']:<36} {r['seconds']:>8} {r['output_tokens']:>10} {r['tokens_per_s']:>8}")
    print(f"ratio pagedserve / static batching: {result['ratio']}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
