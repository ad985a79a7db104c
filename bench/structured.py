"""What structured outputs cost: throughput of a batch with half its rows constrained against the
same batch with none, and grammar compile time (cold, cached) and its effect on time to first token.

    python -m bench.structured [--model DIR] [--requests 64] [--max-tokens 128]

Every row generates exactly ``--max-tokens`` tokens (EOS ignored; the constrained rows follow a
regex that never ends: ``([a-z]+ )*``), so both runs do the same model work and the difference is
the masks: filled on the host by llguidance, applied on the logits' device, advanced per token.
A second pair runs a real JSON schema (rows end when their object is complete) against free rows
generating exactly as many tokens each. Defaults to the demo model (what ``pagedserve serve`` runs). Prints one JSON line and a
table; the ratios are from the same sitting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from pagedserve.bench.table import print_table
from pagedserve.shared.sampling import SamplingParams
from pagedserve.shared.structured import StructuredOutputs
from pagedserve.worker.source.resolve import model_or_default

ENDLESS = StructuredOutputs(regex=r"([a-z]+ )*")
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 100000},
    "kind": {"enum": ["block", "page", "slot"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 4},
    "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "active": {"type": "boolean"}},
              "required": ["name", "active"], "additionalProperties": False}},
    "required": ["id", "kind", "tags", "owner"], "additionalProperties": False}


def timed_generate(llm, prompts, params) -> dict:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


def throughput(llm, prompts, max_tokens: int, repeats: int) -> list[dict]:
    free = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=1)
    half = [SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=1, structured=ENDLESS)
            if i % 2 else free for i in range(len(prompts))]
    schema = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=1, structured=StructuredOutputs(json=SCHEMA))
    json_half = [schema if i % 2 else free for i in range(len(prompts))]
    llm.generate(prompts[:8], half[:4] + json_half[:4], use_tqdm=False)  # warm-up; grammars compiled and cached
    rows = [_median_run(llm, prompts, name, params, repeats)
            for name, params in (("no constraint", free), ("50% regex rows", half), ("50% JSON-schema rows", json_half))]
    # JSON rows end when their object does: the fair baseline is free rows of exactly those lengths.
    lengths = [len(o.outputs[0].token_ids) for o in llm.generate(prompts, json_half, use_tqdm=False)]
    same = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=1) for n in lengths]
    rows.insert(2, _median_run(llm, prompts, "no constraint, JSON rows' lengths", same, repeats))
    for row, base in zip(rows, (rows[0], rows[0], rows[2], rows[2])):
        row["ratio"] = round(row["tokens_per_s"] / base["tokens_per_s"], 3)
    return rows


def _median_run(llm, prompts, name: str, params, repeats: int) -> dict:
    runs = [timed_generate(llm, prompts, params) for _ in range(repeats)]
    return {"case": name, "tokens": runs[0]["tokens"], "seconds": round(statistics.median(r["seconds"] for r in runs), 3),
            "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in runs), 1)}


def first_token_seconds(llm, params) -> float:
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request(f"ttft-{time.perf_counter_ns()}", "How are blocks shared?", params)
    while True:
        outs = engine.step()
        if any(c.token_ids for o in outs for c in o.outputs):
            seconds = time.perf_counter() - start
            break
    while engine.has_unfinished():
        engine.step()
    return seconds


def compile_times(llm, repeats: int) -> dict:
    compiler = llm.engine.grammars
    cold = []
    for i in range(repeats):  # a schema never seen: a fresh key each time
        fresh = StructuredOutputs(json={**SCHEMA, "title": f"cold-{time.perf_counter_ns()}-{i}"})
        start = time.perf_counter()
        compiler.compile(fresh).result()
        cold.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(100):
        compiler.compile(StructuredOutputs(json=SCHEMA)).result()
    cached = (time.perf_counter() - start) / 100
    free = SamplingParams(temperature=0.0, max_tokens=2)
    constrained = SamplingParams(temperature=0.0, max_tokens=2, structured=StructuredOutputs(json=SCHEMA))
    ttft_free = statistics.median(first_token_seconds(llm, free) for _ in range(repeats * 3))
    ttft_cached = statistics.median(first_token_seconds(llm, constrained) for _ in range(repeats * 3))
    return {"compile_cold_ms": round(statistics.median(cold) * 1e3, 2), "compile_cached_ms": round(cached * 1e3, 4),
            "ttft_free_ms": round(ttft_free * 1e3, 2), "ttft_cached_schema_ms": round(ttft_cached * 1e3, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo", help="model directory or GGUF file (default: the random-weight demo model)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    from pagedserve import LLM

    llm = LLM(model_or_default(args.model), dtype=args.dtype)
    prompts = [f"request {i}: explain paged attention " + "and blocks " * (i % 9) for i in range(args.requests)]
    rows = throughput(llm, prompts, args.max_tokens, args.repeats)
    compile_ = compile_times(llm, args.repeats)
    print(json.dumps({"bench": "structured", "requests": args.requests, "max_tokens": args.max_tokens,
                      "model": args.model, "throughput": rows, **compile_}))
    print_table(rows, [("case", lambda r: r["case"]), ("output tokens", lambda r: r["tokens"]),
                       ("tok/s", lambda r: r["tokens_per_s"]), ("vs its baseline", lambda r: r["ratio"])])
    print(f"compile: cold {compile_['compile_cold_ms']} ms, cached {compile_['compile_cached_ms']} ms; time to first "
          f"token: unconstrained {compile_['ttft_free_ms']} ms, cached schema {compile_['ttft_cached_schema_ms']} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
