"""What a quantized KV cache costs in quality, on real weights: the default model (SmolLM2-135M-
Instruct) reads a public-domain text (``bench/texts/declaration.txt``, 2,024 tokens) teacher-forced
through ``prompt_logprobs``, once per ``--kv-cache-dtype``, prefilled in chunks so that every chunk
attends over the cache the earlier ones left. Against the model-dtype cache: next-token top-1
agreement, perplexity, and how far the logprob of each position's token moved on average.

    python -m pagedserve.bench.kv_quality [--model M] [--chunk 512] [--dtypes auto int8 fp8_e4m3 fp8_e5m2]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from importlib import resources
from typing import NamedTuple

from pagedserve.bench.table import print_table
from pagedserve.kernels.backends import KV_CACHE_DTYPES
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.offline_outputs import best_token, prompt_token_logprobs


class Scored(NamedTuple):
    """One position of the text: the logprob of its token, and its most likely token."""
    logprob: float
    best: int | None


def text() -> str:
    return resources.files("pagedserve.bench").joinpath("texts/declaration.txt").read_text(encoding="utf-8")


def read(model: str | None, chunk: int, dtype: str = "float32", **engine) -> list:
    """The prompt logprob entries (top-1 alternatives included) of the text under the given engine
    options (``kv_cache_dtype``, ``quantization``; the exact path without them)."""
    from pagedserve import LLM

    llm = LLM(model, dtype=dtype, max_num_batched_tokens=chunk, num_gpu_blocks=256, **engine)
    ids = llm.tokenizer.encode(text(), add_special_tokens=False)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    return [Scored(logprob, best_token(entry)) for logprob, entry in zip(prompt_token_logprobs(out), out.prompt_logprobs[1:])]


def compare(reference: list, quantized: list) -> dict:
    agree = sum(a.best == b.best for a, b in zip(reference, quantized)) / len(reference)
    # How far each position's logprob of the text's token moved: continuous, so not at the mercy of
    # the few near-ties that decide the agreement.
    moved = sum(abs(a.logprob - b.logprob) for a, b in zip(reference, quantized)) / len(reference)
    ppl = math.exp(-sum(e.logprob for e in quantized) / len(quantized))
    ref_ppl = math.exp(-sum(e.logprob for e in reference) / len(reference))
    return {"positions": len(quantized), "top1_agreement": round(agree, 4), "perplexity": round(ppl, 3),
            "perplexity_change": round(ppl / ref_ppl - 1, 4), "mean_abs_logprob_change": round(moved, 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "int8", "fp8_e4m3", "fp8_e5m2"],
                    choices=KV_CACHE_DTYPES)
    args = ap.parse_args(argv)
    quality_table("kv_quality", "kv_cache_dtype", args.dtypes, "auto", args.model, args.chunk)
    return 0


def quality_table(bench: str, option: str, names: list[str], exact: str, model: str | None, chunk: int) -> None:
    """Each value of the engine option ``option`` against the exact path (``exact``): one JSON line
    and a table."""
    reference = read(model, chunk)
    rows = [{option: name, **compare(reference, reference if name == exact else read(model, chunk, **{option: name}))}
            for name in names]
    print(json.dumps({"bench": bench, "model": model or "default", "chunk": chunk, "results": rows}))
    print_table(rows, [(k, lambda r, k=k: r[k]) for k in (option, "positions", "top1_agreement", "perplexity",
                                                          "perplexity_change", "mean_abs_logprob_change")])


if __name__ == "__main__":
    sys.exit(main())
