"""A quantized GGUF executed as stored, held to transformers' dequantized reading of the same file:
the model reads ``bench/texts/declaration.txt`` teacher-forced (``bench/kv_quality.py``'s way), once
under transformers (``from_pretrained(..., gguf_file=...)``: every block dequantized to float32) and
once per engine configuration; against transformers: perplexity, its change, next-token top-1
agreement and how far each position's logprob moved.

    python -m pagedserve.bench.gguf_quality [--model qwen2.5-coder-1.5b-instruct-q4_k_m] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from pagedserve.bench.kv_quality import text
from pagedserve.bench.table import print_table
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.offline_outputs import best_token, prompt_token_logprobs

CONFIGS = {  # name -> LLM options
    "as stored, float32": {"quantization": "gguf", "dtype": "float32"},
    "as stored, bfloat16": {"quantization": "gguf", "dtype": "bfloat16"},
    "dequantized, float32": {"quantization": "none", "dtype": "float32"},
    "dequantized, bfloat16": {"quantization": "none", "dtype": "bfloat16"},
    # the row kernel with llama.cpp's int8 inputs (a prefill chunk of the GEMM size never reaches it: --chunk 16)
    "as stored, int8 inputs, float32": {"quantization": "gguf", "dtype": "float32", "gguf_activations": "int8"},
    "as stored, int8 inputs, bfloat16": {"quantization": "gguf", "dtype": "bfloat16", "gguf_activations": "int8"},
}


def transformers_logprobs(gguf: Path, ids: list[int]) -> tuple[list[float], list[int]]:
    """Each position's logprob of the text's next token, and its top-1 token, under transformers' float32
    reading of the file."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    picked = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return picked.tolist(), logits[:-1].argmax(dim=-1).tolist()


def engine_logprobs(model: str, ids: list[int], chunk: int, **options) -> tuple[list[float], list[int]]:
    from pagedserve import LLM

    llm = LLM(model, max_num_batched_tokens=chunk, num_gpu_blocks=max(64, len(ids) // 16 + 8), **options)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    return prompt_token_logprobs(out), [best_token(entry) for entry in out.prompt_logprobs[1:]]


def compare(reference: tuple[list[float], list[int]], ours: tuple[list[float], list[int]]) -> dict:
    (ref_lp, ref_top), (lp, top) = reference, ours
    ppl, ref_ppl = math.exp(-sum(lp) / len(lp)), math.exp(-sum(ref_lp) / len(ref_lp))
    return {"positions": len(lp), "perplexity": round(ppl, 4), "perplexity_change": round(ppl / ref_ppl - 1, 5),
            "top1_agreement": round(sum(a == b for a, b in zip(ref_top, top)) / len(top), 4),
            "mean_abs_logprob_change": round(sum(abs(a - b) for a, b in zip(ref_lp, lp)) / len(lp), 5)}


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from pagedserve.worker.source.resolve import model_or_default, resolve_model_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct-q4_k_m", help="a GGUF file or packaged model")
    ap.add_argument("--tokens", type=int, default=1024, help="how much of the text is read")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = ap.parse_args(argv)
    gguf = Path(model_or_default(args.model))
    ids = AutoTokenizer.from_pretrained(resolve_model_dir(gguf)).encode(text(), add_special_tokens=False)[:args.tokens]
    reference = transformers_logprobs(gguf, ids)
    ref_ppl = math.exp(-sum(reference[0]) / len(reference[0]))
    rows = [{"config": "transformers, float32", "positions": len(ids) - 1, "perplexity": round(ref_ppl, 4),
             "perplexity_change": 0.0, "top1_agreement": 1.0, "mean_abs_logprob_change": 0.0}]
    rows += [{"config": name, **compare(reference, engine_logprobs(str(gguf), ids, args.chunk, **CONFIGS[name]))}
             for name in args.configs]
    print(json.dumps({"bench": "gguf_quality", "model": gguf.name, "results": rows}))
    print_table(rows, [(k, lambda r, k=k: r[k]) for k in ("config", "positions", "perplexity", "perplexity_change",
                                                          "top1_agreement", "mean_abs_logprob_change")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
