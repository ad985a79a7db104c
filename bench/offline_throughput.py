"""Offline throughput: pagedserve ``LLM.generate`` vs transformers ``generate`` with static batches.

Same model, same prompts, same output lengths (EOS ignored), same process, one after the other.
The baseline pads each batch of ``--hf-batch`` prompts on the left and runs it until its longest
output is done, which is what static batching does; both count only the requested tokens.

    python -m pagedserve.bench.offline_throughput [--requests 128] [--dtype float32] [--hf-batch 32]
    python -m pagedserve.bench.offline_throughput --model default   # the real default model (SmolLM2-135M)
    python -m pagedserve.bench.offline_throughput --model ./model.gguf
    python -m pagedserve.bench.offline_throughput --ngram 4 --no-baseline   # n-gram drafts (copy-heavy on a random model)
    python -m pagedserve.bench.offline_throughput --async-scheduling       # step N+1 planned while step N runs

``--model``: any model pagedserve serves (a directory, a GGUF file, a hub id; ``default``: the
default model); transformers reads a GGUF with its own reader. Without it, a random-weight preset.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from pagedserve.kernels.backends import KV_CACHE_DTYPES
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.source.demo_model import build_model
from pagedserve.worker.source.gguf_dir import LINK as GGUF_LINK
from pagedserve.worker.source.resolve import model_dir as model_dir_of

PRESETS = {  # the 115M model of the CPU figures, and a ~1.1B Llama-shaped one for GPUs
    "llama-90m": dict(hidden_size=768, num_layers=14, num_heads=12, num_kv_heads=4, intermediate_size=2048, vocab_size=512),
    "llama-1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
                     vocab_size=512, padded_vocab_size=32000),
}


def workload(seed: int, count: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([rng.randint(10, vocab - 1) for _ in range(rng.randint(32, 512))], rng.randint(32, 256))
        for _ in range(count)
    ]


def run_pagedserve(path: Path, work, dtype: str, kv_bytes: int | None, max_batched: int, eager: bool,
                   kv_cache_dtype: str = "auto", ngram: int = 0, ahead: bool = False) -> dict:
    """``ngram`` > 0: prompt-lookup drafts of up to that many tokens (a random model's greedy text
    loops, which lookup predicts: the copy-heavy case); ``ahead``: async scheduling."""
    from pagedserve import LLM

    speculative = {"method": "ngram", "num_speculative_tokens": ngram} if ngram else None
    llm = LLM(path, dtype=dtype, kv_cache_memory=kv_bytes, max_num_batched_tokens=max_batched, max_num_seqs=256,
              enforce_eager=eager, kv_cache_dtype=kv_cache_dtype, speculative_config=speculative, async_scheduling=ahead)
    llm.generate(work[0][0], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up (kernel compilation on CUDA)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in work], params, use_tqdm=True)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    name = "pagedserve" + (" (CUDA graphs)" if llm.engine.runner.graphs is not None else "") + \
        (f" kv {kv_cache_dtype}" if kv_cache_dtype != "auto" else "") + (f" ngram k={ngram}" if ngram else "") + \
        (" async" if llm.engine.runs_ahead else "")
    stats = llm.engine.stats()
    result = {"engine": name, "seconds": round(seconds, 2), "output_tokens": tokens,
              "tokens_per_s": round(tokens / seconds, 1), "preemptions": stats["num_preemptions_total"]}
    if ngram:
        drafted = stats.get("spec_decode_num_draft_tokens_total", 0)
        result["acceptance"] = round(stats.get("spec_decode_num_accepted_tokens_total", 0) / max(drafted, 1), 3)
    device = llm.engine.runner.device
    if device.type == "cuda":  # the pool's size is in the engine's "gpu memory" log line
        free, total = torch.cuda.mem_get_info(device)
        result["gpu_gib"] = {"in_use_after_run": round((total - free) / 2**30, 2),
                             "peak_allocated": round(torch.cuda.max_memory_allocated(device) / 2**30, 2)}
    return result


def run_transformers(path: Path, work, dtype: str, batch: int, device: str) -> dict:
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    gguf = {"gguf_file": GGUF_LINK} if (path / GGUF_LINK).exists() else {}  # a GGUF's model directory
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **gguf).to(device).eval()
    pad = model.config.pad_token_id
    start = time.perf_counter()
    tokens = 0
    for i in tqdm(range(0, len(work), batch), desc="transformers batches"):
        chunk = work[i : i + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device)
        longest = max(n for _, n in chunk)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad)
        tokens += sum(n for _, n in chunk)  # what was asked for; the padding steps are waste
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {"engine": f"transformers static batch={batch}", "seconds": round(seconds, 2), "output_tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--kv-cache-memory", type=int, default=None,
                    help="bytes (default: 3 GiB on a CPU; on CUDA what memory leaves after profiling a step)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama-90m")
    ap.add_argument("--model-dir", type=Path, default=None, help="default: ~/.cache/pagedserve/bench-<preset>")
    ap.add_argument("--model", default=None, help="a model to serve instead of a preset: a directory, a .gguf file, "
                                                   "a hub id, or 'default' (the default model)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON line here")
    ap.add_argument("--enforce-eager", action="store_true", help="CUDA: no CUDA graphs for decode steps")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    ap.add_argument("--no-baseline", action="store_true", help="skip transformers (pagedserve alone)")
    ap.add_argument("--ngram", type=int, default=0, metavar="K", help="n-gram (prompt lookup) drafts of up to K tokens")
    ap.add_argument("--async-scheduling", action="store_true", help="plan each step while the one before runs")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.model is not None:
        model_dir = Path(model_dir_of(None if args.model == "default" else args.model))
        model = {"model": args.model, "vocab_size": json.loads((model_dir / "config.json").read_text())["vocab_size"]}
    else:
        model = PRESETS[args.preset]
        model_dir = args.model_dir or Path.home() / ".cache" / "pagedserve" / f"bench-{args.preset}"
        if not (model_dir / "config.json").exists():
            build_model(model_dir, "llama", **model, seed=0, device=device, dtype=args.dtype)
    kv_bytes = args.kv_cache_memory if args.kv_cache_memory or device == "cuda" else 3 << 30
    work = workload(args.seed, args.requests, model.get("padded_vocab_size") or model["vocab_size"])
    ours = run_pagedserve(model_dir, work, args.dtype, kv_bytes, args.max_num_batched_tokens, args.enforce_eager,
                          args.kv_cache_dtype, args.ngram, args.async_scheduling)
    base = None if args.no_baseline else run_transformers(model_dir, work, args.dtype, args.hf_batch, device)
    result = {
        "bench": "offline_throughput", "requests": args.requests, "dtype": args.dtype, "device": device,
        "threads": torch.get_num_threads(), "preset": None if args.model else args.preset, "model": model,
        "kv_cache_dtype": args.kv_cache_dtype, "ngram": args.ngram,
        "async_scheduling": args.async_scheduling, "kv_cache_memory": kv_bytes, "results": [r for r in (ours, base) if r],
        "ratio": round(ours["tokens_per_s"] / base["tokens_per_s"], 2) if base else None,
    }
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result) + "\n")
    print(f"{'engine':<36} {'seconds':>8} {'out tokens':>10} {'tok/s':>8} {'preemptions':>11}")
    for r in result["results"]:
        print(f"{r['engine']:<36} {r['seconds']:>8} {r['output_tokens']:>10} {r['tokens_per_s']:>8} {r.get('preemptions', ''):>11}")
    if base:
        print(f"ratio pagedserve / static batching: {result['ratio']}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
