"""What a lossy decode path costs, on real weights, through decode steps themselves: the default
model (SmolLM2-135M-Instruct) continues 8 passages of a public-domain text
(``bench/texts/declaration.txt``) greedily for ``--tokens`` tokens under each configuration, and
the exact path (the model-dtype cache) then reads each continuation teacher-forced
(``prompt_logprobs``). Per generated token: whether it is the exact path's top-1 there, and how far
its logprob moved from the exact path's. ``kv_quality`` measures a cache through prefill; this
covers what only a decode step computes (``--quantized-products``). Every configuration runs on the torch
attention reference, so only the cache and the products differ.

    python -m pagedserve.bench.decode_quality [--model M] [--tokens 64] [--prompt 128]
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from pagedserve.bench.kv_quality import text
from pagedserve.bench.table import print_table
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.offline_outputs import best_token

PASSAGES = 8
CONFIGS = {  # name -> engine options beside the exact path's
    "auto (exact)": {},
    "int8": {"kv_cache_dtype": "int8"},
    "int8, quantized products": {"kv_cache_dtype": "int8", "quantized_products": True},
    "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
    "fp8_e4m3, quantized products": {"kv_cache_dtype": "fp8_e4m3", "quantized_products": True},
}


def engine(model: str | None, **options):
    from pagedserve import LLM

    return LLM(model, dtype="float32", attention_backend="torch", num_gpu_blocks=256, **options)


def passages(tokenizer, prompt: int, count: int = PASSAGES) -> list[list[int]]:
    """``count`` prompts of ``prompt`` tokens, spread over the text."""
    ids = tokenizer.encode(text(), add_special_tokens=False)
    step = (len(ids) - prompt) // count
    return [ids[i * step:i * step + prompt] for i in range(count)]


def continuations(llm, prompts: list[list[int]], tokens: int) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy continuation under ``llm``: its tokens and their logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    return [(list(o.token_ids), [entry[t].logprob for t, entry in zip(o.token_ids, o.logprobs)]) for o in outs]


def judged(exact, prompts: list[list[int]], paths: list[tuple[list[int], list[float]]]) -> dict:
    """The continuations ``paths`` read by the exact engine: agreement with its top-1, the mean
    logprob move, and the exact path's perplexity of the generated text."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = exact.generate([prompt + ids for prompt, (ids, _) in zip(prompts, paths)], params, use_tqdm=False)
    agree = moved = nll = 0.0
    count = 0
    for prompt, (ids, logprobs), out in zip(prompts, paths, outs):
        entries = out.prompt_logprobs[len(prompt):]
        for token, logprob, entry in zip(ids, logprobs, entries):
            agree += best_token(entry) == token
            moved += abs(entry[token].logprob - logprob)
            nll -= entry[token].logprob
            count += 1
    return {"positions": count, "top1_agreement": round(agree / count, 4),
            "mean_abs_logprob_change": round(moved / count, 4), "exact_perplexity": round(math.exp(nll / count), 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens generated per passage")
    ap.add_argument("--prompt", type=int, default=128, help="tokens of each passage")
    args = ap.parse_args(argv)
    exact = engine(args.model)
    prompts = passages(exact.tokenizer, args.prompt)
    rows = []
    for name, options in CONFIGS.items():
        llm = exact if not options else engine(args.model, **options)
        rows.append({"config": name, **judged(exact, prompts, continuations(llm, prompts, args.tokens))})
    print(json.dumps({"bench": "decode_quality", "model": args.model or "default", "tokens": args.tokens,
                      "prompt": args.prompt, "results": rows}))
    print_table(rows, [(k, lambda r, k=k: r[k]) for k in rows[0]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
