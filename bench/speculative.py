"""Speculative decoding by prompt lookup, one stream at a time, on the real default model
(SmolLM2-135M-Instruct): decode tokens/s with and without it, on prompts whose answers copy from
them (quote a paragraph, edit a function) and on W64's random prompts (where lookup rarely finds
anything, and must cost nothing), with the acceptance rate by position in the draft.

    python -m pagedserve.bench.speculative [--model PATH] [--count 4] [--max-tokens 128] [--k 6] [--lookup-min 2]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pagedserve.bench.peer_ratio import w64
from pagedserve.bench.table import print_table
from pagedserve.shared.prompts import encode_chat
from pagedserve.shared.sampling import SamplingParams

CODE = '''def total_price(items, tax):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    discount = subtotal * 0.1 if subtotal > 100 else 0
    return (subtotal - discount) * (1 + tax)
'''


def copy_prompts(tokenizer, count: int) -> list[list[int]]:
    """Chats whose answer quotes or edits text in the prompt (the shipped declaration's paragraphs)."""
    text = (Path(__file__).parent / "texts" / "declaration.txt").read_text()
    paragraphs = [p for p in text.split("\n\n")[1:] if len(p) > 200]
    asks = [f"Repeat this paragraph word for word:\n\n{p[:600]}" for p in paragraphs[: max(1, count - 1)]]
    asks.append(f"Rename the variable subtotal to net in this function and print the whole function:\n\n{CODE}")
    return [encode_chat(tokenizer, [{"role": "user", "content": ask}]) for ask in asks[:count]]


def one_stream(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Each prompt alone: decode tokens/s after the first token, summed over the prompts."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    decode_tokens, decode_seconds, outputs = 0, 0.0, []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"s{i}", prompt, params)
        first = None
        while engine.has_unfinished():
            for out in engine.step():
                if first is None and out.outputs[0].token_ids:
                    first = (time.perf_counter(), len(out.outputs[0].token_ids))
                if out.finished:
                    outputs.append(list(out.outputs[0].token_ids))
                    decode_tokens += len(out.outputs[0].token_ids) - first[1]
                    decode_seconds += time.perf_counter() - first[0]
    return {"decode_tokens_per_s": decode_tokens / max(decode_seconds, 1e-9), "outputs": outputs}


def main() -> None:
    from pagedserve import LLM

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory or .gguf (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--count", type=int, default=4, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=6, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max,
            "prompt_lookup_min": args.lookup_min}
    rows = []
    for label, speculative in (("off", None), (f"ngram k={args.k}", spec)):
        llm = LLM(args.model, dtype=args.dtype, speculative_config=speculative)
        workloads = {"copies from its prompt": copy_prompts(llm.tokenizer, args.count),
                     "W64 random": [p for p, _ in w64(llm.engine.info.config.vocab_size, args.count)]}
        for workload, prompts in workloads.items():
            before = llm.engine.stats()
            result = one_stream(llm.engine, prompts, args.max_tokens)
            after = llm.engine.stats()
            drafted = after.get("spec_decode_num_draft_tokens_total", 0) - before.get("spec_decode_num_draft_tokens_total", 0)
            accepted = after.get("spec_decode_num_accepted_tokens_total", 0) - before.get("spec_decode_num_accepted_tokens_total", 0)
            rows.append({"bench": "speculative", "config": label, "workload": workload, "prompts": len(prompts),
                         "max_tokens": args.max_tokens, "decode_tokens_per_s": result["decode_tokens_per_s"],
                         "draft_tokens": drafted, "accepted_tokens": accepted,
                         "acceptance": accepted / drafted if drafted else None, "outputs": result["outputs"]})
        if speculative:
            rows[-1]["accepted_by_position"] = llm.engine.spec_counts()
    for row in rows:
        base = next(r for r in rows if r["workload"] == row["workload"] and r["config"] == "off")
        row["speedup"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        row["same_tokens"] = row["outputs"] == base["outputs"]
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "outputs"}))
    print_table(rows, [("workload", lambda r: r["workload"]), ("speculation", lambda r: r["config"]),
                       ("decode tok/s", lambda r: f"{r['decode_tokens_per_s']:.1f}"),
                       ("vs off", lambda r: f"{r['speedup']:.2f}x"),
                       ("acceptance", lambda r: "" if r["acceptance"] is None else f"{r['acceptance']:.0%}"),
                       ("same tokens", lambda r: "yes" if r["same_tokens"] else "NO")])


if __name__ == "__main__":
    main()
