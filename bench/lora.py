"""The cost of the LoRA path: one batch's output tokens/s with its rows spread over 0 (the base
model), 1, 4 and 8 adapters, against the same engine without LoRA. The adapters are random, rank
``--rank`` on every q/k/v/o and gate/up/down, written as PEFT directories (no PEFT needed).

    python -m pagedserve.bench.lora [--model M] [--batch 16] [--prompt-len 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedserve import LLM, LoRARequest
from pagedserve.bench.table import print_table
from pagedserve.shared.sampling import SamplingParams

SPREADS = (0, 1, 4, 8)  # adapters the batch's rows are spread over (0: every row the base model's)


def write_adapter(path: Path, shapes: dict[tuple[int, str], tuple[int, int]], rank: int, seed: int) -> None:
    """A random PEFT LoRA directory for a model whose targets have ``shapes`` ((layer, target) -> (in, out))."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for (layer, target), (width, outs) in shapes.items():
        where = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        prefix = f"base_model.model.model.layers.{layer}.{where}.{target}"
        tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, width, generator=generator) * width ** -0.5
        tensors[f"{prefix}.lora_B.weight"] = torch.randn(outs, rank, generator=generator) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    targets = sorted({target for _, target in shapes})
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": targets}))


def run(llm: LLM, adapters: list[LoRARequest], args, seed: int) -> dict:
    rng = random.Random(seed)  # new prompts every run: no prefix-cache hit between runs
    vocab = llm.engine.info.config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    requests = [adapters[i % len(adapters)] if adapters else None for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
    seconds = time.perf_counter() - started
    return {"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": round(seconds, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2, help="runs per row; the best is reported")
    args = ap.parse_args(argv)
    rows = []

    def measure(name: str, llm: LLM, adapters: list[LoRARequest]) -> None:
        best = max((run(llm, adapters, args, seed=len(rows) * 100 + k) for k in range(args.repeats)),
                   key=lambda r: r["tokens"] / r["seconds"])
        rows.append({"config": name, "adapters": len(adapters), **best,
                     "tok_s": round(best["tokens"] / best["seconds"], 1)})

    measure("lora off", LLM(args.model, dtype=args.dtype), [])
    llm = LLM(args.model, dtype=args.dtype, enable_lora=True, max_loras=max(SPREADS), max_lora_rank=args.rank)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = []
        for i in range(max(SPREADS)):
            write_adapter(Path(tmp) / f"a{i}", llm.engine.adapters.shapes, args.rank, seed=i)
            adapters.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        for spread in SPREADS:
            measure("base rows" if spread == 0 else f"{spread} adapter(s)", llm, adapters[:spread])
    for row in rows:
        row["vs_off"] = round(row["tok_s"] / rows[0]["tok_s"], 2)
    print(json.dumps({"bench": "lora", "model": args.model or "default", "dtype": args.dtype, "batch": args.batch,
                      "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "rank": args.rank, "results": rows}))
    print_table(rows, [(k, lambda r, k=k: r[k]) for k in ("config", "adapters", "tokens", "seconds", "tok_s", "vs_off")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
