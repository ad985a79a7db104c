"""Speculative decoding by prompt lookup on the real default model (SmolLM2-135M-Instruct): tokens/s
with and without it on prompts whose answers copy from them (quote a paragraph, edit a function),
one stream and 16 at once, and on W64's random prompts, greedy (this model's answer to noise loops,
which lookup predicts) and sampled at temperature 1 (text that does not repeat: speculation must
cost nearly nothing), one stream and W64's 64 requests at once; with the acceptance rate and
whether the tokens equal those without speculation (greedy and seeded rows must).

    python -m pagedserve.bench.speculative [--model PATH] [--count 4] [--max-tokens 128] [--k 6] [--lookup-min 2] [--only NAME] [--repeats 3]
        [--draft PATH|same --draft-quantization int4 --draft-k 4 [--no-ngram]]

With ``--draft`` a draft model's drafts are timed too (``same``: the model itself with its weights
quantized, a draft with the target's tokenizer where no smaller one is at hand).
"""

from __future__ import annotations

import argparse
import json
import statistics
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


def quote_asks(count: int) -> list[str]:
    """Requests to quote ``count`` of the shipped declaration's paragraphs word for word."""
    text = (Path(__file__).parent / "texts" / "declaration.txt").read_text()
    paragraphs = [p for p in text.split("\n\n")[1:] if len(p) > 200]
    return [f"Repeat this paragraph word for word:\n\n{p[:600]}" for p in paragraphs[:count]]


def copy_prompts(tokenizer, count: int) -> list[list[int]]:
    """Chats whose answer quotes or edits text in the prompt (the shipped declaration's paragraphs)."""
    asks = quote_asks(max(1, count - 1))
    asks.append(f"Rename the variable subtotal to net in this function and print the whole function:\n\n{CODE}")
    return [encode_chat(tokenizer, [{"role": "user", "content": ask}]) for ask in asks[:count]]


def quote_prompts(tokenizer, count: int) -> list[list[int]]:
    """Chats whose whole answer quotes a paragraph of the prompt (the code edit is left out: a 135M model
    answers it with prose or a loop, not the edited function; docs/benchmarks.md)."""
    return [encode_chat(tokenizer, [{"role": "user", "content": ask}]) for ask in quote_asks(count)]


def run(engine, prompts: list[list[int]], params: list[SamplingParams], at_once: bool) -> dict:
    """The prompts one at a time (decode tokens/s after each first token, summed) or all at once
    (output tokens/s over the wall time, prefill included, as the peers' W64 is read)."""
    decode_tokens, decode_seconds, outputs, first = 0, 0.0, {}, {}
    started = time.perf_counter()
    pending = list(enumerate(zip(prompts, params)))
    while pending or engine.has_unfinished():
        if pending and (at_once or not engine.has_unfinished()):
            for i, (prompt, p) in pending if at_once else pending[:1]:
                engine.add_request(f"s{i}", prompt, p)
            pending = [] if at_once else pending[1:]
        for out in engine.step():
            tokens = out.outputs[0].token_ids
            if out.request_id not in first and tokens:
                first[out.request_id] = (time.perf_counter(), len(tokens))
            if out.finished:
                outputs[out.request_id] = list(tokens)
                decode_tokens += len(tokens) - first[out.request_id][1]
                decode_seconds += time.perf_counter() - first[out.request_id][0]
    wall = time.perf_counter() - started
    generated = sum(len(t) for t in outputs.values())
    rate = generated / wall if at_once else decode_tokens / max(decode_seconds, 1e-9)
    return {"tokens_per_s": rate, "outputs": [outputs[f"s{i}"] for i in range(len(prompts))]}


def workloads(tokenizer, vocab: int, count: int, max_tokens: int) -> list[tuple[str, list[list[int]], list[SamplingParams], bool]]:
    """(name, prompts, params, all at once): what speculation is for (text that copies, one stream
    and 16 at once; quotes that end with the answer's end of turn, where the copies run on past it) and what it must not slow down (sampled text that does not repeat, one stream
    and W64's 64 requests at once)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    copies = copy_prompts(tokenizer, count)
    many = [copies[i % len(copies)] for i in range(16)]
    random_work = w64(vocab, count)
    batch = w64(vocab)
    quotes = quote_prompts(tokenizer, count)
    to_the_end = SamplingParams(temperature=0.0, max_tokens=max_tokens)  # the answer ends at its end of turn
    return [
        ("copies, one stream", copies, [greedy] * len(copies), False),
        ("quotes to the answer's end, one stream", quotes, [to_the_end] * len(quotes), False),
        ("W64 random greedy, one stream", [p for p, _ in random_work], [greedy] * len(random_work), False),
        ("W64 random sampled T=1, one stream", [p for p, _ in random_work],
         [SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=True) for i in range(len(random_work))], False),
        ("copies, 16 at once", many, [greedy] * len(many), True),
        ("W64 sampled T=1, 64 at once", [p for p, _ in batch],
         [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, (_, n) in enumerate(batch)], True),
    ]


def dump_workloads(args) -> None:
    """The workloads as token ids and sampling fields, so a peer's engine runs exactly them."""
    from transformers import AutoConfig, AutoTokenizer

    from pagedserve.worker.source.resolve import model_or_default, resolve_model_dir

    model_dir = resolve_model_dir(model_or_default(args.model))
    tokenizer, vocab = AutoTokenizer.from_pretrained(model_dir), AutoConfig.from_pretrained(model_dir).vocab_size
    out = [{"workload": name, "at_once": at_once, "prompts": prompts,
            "params": [{"temperature": p.temperature, "seed": p.seed, "max_tokens": p.max_tokens, "ignore_eos": p.ignore_eos}
                       for p in params]}
           for name, prompts, params, at_once in workloads(tokenizer, vocab, args.count, args.max_tokens)]
    args.dump_prompts.write_text(json.dumps(out))
    print(f"{len(out)} workloads written to {args.dump_prompts} (model directory {model_dir})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model directory or .gguf (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--count", type=int, default=4, help="prompts per one-stream workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=6, help="num_speculative_tokens")
    parser.add_argument("--lookup-min", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--lookup-max", type=int, default=4, help="prompt_lookup_max")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--only", help="run only the workloads whose name contains this")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each workload, the configurations alternating; "
                        "tok/s and the ratio to off are the medians (the ratio of each repeat's pair)")
    parser.add_argument("--draft", help="also time a draft model: its path, or 'same' (the model itself, its weights "
                        "quantized by --draft-quantization)")
    parser.add_argument("--draft-quantization", default="int4", help="the draft's weights: none, int8 or int4")
    parser.add_argument("--draft-k", type=int, help="the draft's num_speculative_tokens (default: --k)")
    parser.add_argument("--no-ngram", action="store_true", help="time no prompt lookup (off and the draft only)")
    parser.add_argument("--dump-prompts", type=Path, help="write the workloads (token ids and sampling) as JSON for "
                        "bench/vllm_speculative.py and stop")
    return parser.parse_args()


def configurations(args) -> list[tuple[str, dict | None]]:
    """(label, speculative config): off first, then prompt lookup and the draft model as asked."""
    configs: list[tuple[str, dict | None]] = [("off", None)]
    if not args.no_ngram:
        configs.append((f"ngram k={args.k}", {"method": "ngram", "num_speculative_tokens": args.k,
                                               "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min}))
    if args.draft:
        from pagedserve.worker.source.packaged_models import packaged_model_file

        path = (args.model or str(packaged_model_file(download=False))) if args.draft == "same" else args.draft
        k = args.draft_k or args.k
        configs.append((f"draft {args.draft_quantization} k={k}", {"model": path, "num_speculative_tokens": k,
                                                                         "quantization": args.draft_quantization}))
    return configs


def paired_runs(engines, prompts, params, at_once: bool, repeats: int) -> dict[str, list[dict]]:
    """Each configuration's runs of one workload, the configurations alternating (each repeat a pair
    within a minute), with the drafted and kept tokens each run added."""
    runs: dict[str, list[dict]] = {label: [] for label, _ in engines}
    for _ in range(repeats):
        for label, llm in engines:
            before = llm.engine.stats()
            result = run(llm.engine, prompts, params, at_once)
            after = llm.engine.stats()
            result["drafted"], result["accepted"] = (
                after.get(f"spec_decode_num_{name}_tokens_total", 0) - before.get(f"spec_decode_num_{name}_tokens_total", 0)
                for name in ("draft", "accepted"))
            runs[label].append(result)
    return runs


def summary(workload: str, prompts, runs: dict[str, list[dict]], args) -> list[dict]:
    """One row per configuration: median tok/s and ratio to off, acceptance, whether its tokens are off's."""
    rows = []
    for label, results in runs.items():
        drafted, accepted = sum(r["drafted"] for r in results), sum(r["accepted"] for r in results)
        ratios = [r["tokens_per_s"] / off["tokens_per_s"] for r, off in zip(results, runs["off"])]
        rows.append({"bench": "speculative", "config": label, "workload": workload, "prompts": len(prompts),
                     "max_tokens": args.max_tokens, "repeats": args.repeats,
                     "tokens_per_s": statistics.median(r["tokens_per_s"] for r in results),
                     "speedup": statistics.median(ratios), "speedups": ratios,
                     "draft_tokens": drafted, "accepted_tokens": accepted,
                     "acceptance": accepted / drafted if drafted else None,
                     "same_tokens": all(r["outputs"] == off["outputs"] for r, off in zip(results, runs["off"]))})
    return rows


def main() -> None:
    from pagedserve import LLM

    args = parse_args()
    if args.dump_prompts:
        dump_workloads(args)
        return
    engines = [(label, LLM(args.model, dtype=args.dtype, speculative_config=speculative))
               for label, speculative in configurations(args)]
    first = engines[0][1]
    rows = []
    for workload, prompts, params, at_once in workloads(first.tokenizer, first.engine.info.config.vocab_size,
                                                         args.count, args.max_tokens):
        if not args.only or args.only in workload:
            rows += summary(workload, prompts, paired_runs(engines, prompts, params, at_once, args.repeats), args)
    for label, llm in engines:
        if label != "off":
            next(r for r in reversed(rows) if r["config"] == label)["accepted_by_position"] = llm.engine.spec_counts()
    for row in rows:
        print(json.dumps(row))
    print_table(rows, [("workload", lambda r: r["workload"]), ("speculation", lambda r: r["config"]),
                       ("tok/s", lambda r: f"{r['tokens_per_s']:.1f}"),
                       ("vs off", lambda r: f"{r['speedup']:.2f}x"),
                       ("each repeat", lambda r: " ".join(f"{x:.2f}" for x in r["speedups"])),
                       ("acceptance", lambda r: "" if r["acceptance"] is None else f"{r['acceptance']:.0%}"),
                       ("same tokens", lambda r: "yes" if r["same_tokens"] else "NO")])


if __name__ == "__main__":
    main()
