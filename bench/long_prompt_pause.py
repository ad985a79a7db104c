"""A long prompt beside streaming requests (issue #64's scenario, the engine alone): ``--streams``
requests decode (``--output`` tokens each); ``--warm`` seconds in, a fresh ``--prompt``-token prompt
arrives. Measured: the long prompt's time to its first token, the streams' inter-token gaps before it
came (p50) and while it prefilled (p50, p99 and the longest: the pause every stream sees), and the
streams' tokens/s over the whole run. ``--max-step-ms`` is the engine's step target (0: off, chunks
sized by the token budget alone); each value given runs on its own engine, one after the other.

    python -m pagedserve.bench.long_prompt_pause [--model M] [--streams 8] [--prompt 7290] [--max-step-ms 0 100]
"""

from __future__ import annotations

import argparse
import json
import random
import time

from pagedserve.bench.stats import percentiles
from pagedserve.bench.table import print_table
from pagedserve.shared.sampling import SamplingParams


def run(model: str | None, streams: int, prompt: int, output: int, warm_s: float, max_step_ms: float) -> dict:
    from pagedserve import LLM

    llm = LLM(model, max_step_ms=max_step_ms or None, max_model_len=prompt + 64)
    engine, rng = llm.engine, random.Random(0)
    vocab = engine.info.config.vocab_size
    ask = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"s{i}", [rng.randint(100, vocab - 1) for _ in range(64)], ask)
    last: dict[str, float] = {}
    before, during, started, long_at, ttft, tokens = [], [], time.perf_counter(), None, None, 0
    while ttft is None:
        now_outputs = engine.step()
        now = time.perf_counter()
        for out in now_outputs:
            if out.request_id == "long":
                ttft = now - long_at if out.outputs[0].token_ids else None
                continue
            if out.outputs[0].new_token_ids:
                tokens += len(out.outputs[0].new_token_ids)
                if out.request_id in last:
                    (during if long_at is not None else before).append(now - last[out.request_id])
                last[out.request_id] = now
        if long_at is None and now - started >= warm_s:
            engine.add_request("long", [rng.randint(100, vocab - 1) for _ in range(prompt)],
                               SamplingParams(temperature=0.0, max_tokens=1))
            long_at = time.perf_counter()
    wall = time.perf_counter() - started
    return {"bench": "long_prompt_pause", "max_step_ms": max_step_ms, "streams": streams, "prompt": prompt,
            "ttft_s": round(ttft, 2), "itl_before": percentiles(before), "itl_during": percentiles(during),
            "longest_gap_s": round(max(during, default=0.0), 3), "stream_tok_s": round(tokens / wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=7290)
    parser.add_argument("--output", type=int, default=1200)
    parser.add_argument("--warm", type=float, default=3.0, help="seconds of streaming before the long prompt")
    parser.add_argument("--max-step-ms", type=float, nargs="+", default=[0, 100])
    args = parser.parse_args()
    rows = []
    for target in args.max_step_ms:
        rows.append(run(args.model, args.streams, args.prompt, args.output, args.warm, target))
        print(json.dumps(rows[-1]), flush=True)
    print_table(rows, [("max step ms", lambda r: r["max_step_ms"] or "off"), ("long prompt TTFT s", lambda r: r["ttft_s"]),
                       ("ITL p50 before ms", lambda r: r["itl_before"]["p50_ms"]),
                       ("ITL p50 during ms", lambda r: r["itl_during"]["p50_ms"]),
                       ("ITL p99 during ms", lambda r: r["itl_during"]["p99_ms"]),
                       ("longest gap s", lambda r: r["longest_gap_s"]), ("stream tok/s", lambda r: r["stream_tok_s"])])


if __name__ == "__main__":
    main()
