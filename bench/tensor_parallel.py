"""What tensor parallel costs on one host: output tokens/s at TP=1 and TP=2 (gloo, one process per
rank sharing the cores), one stream and a batch, and at TP=2 the share of rank 0's wall time spent
in collectives (the layers' all-reduces, the head's gather, the plan's broadcast: time waiting for
the other rank included). TP=1 is also run without the C decode stack, which TP>1 does not use, so
the cost of the design and the cost of leaving that stack are told apart.

    python -m pagedserve.bench.tensor_parallel [--preset llama-90m] [--batch 16] [--prompt-len 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from pagedserve import LLM
from pagedserve.bench.offline_throughput import PRESETS
from pagedserve.bench.table import print_table
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.source.demo_model import build_model


def run(llm: LLM, batch: int, args, seed: int) -> dict:
    rng = random.Random(seed)  # new prompts every run: no prefix-cache hit between runs
    vocab = llm.engine.info.config.vocab_size
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    group = llm.engine.ranks.group if llm.engine.ranks is not None else None
    before = dict(group.seconds) if group else {}
    started = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    row = {"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "seconds": round(seconds, 3)}
    if group:
        spent = {kind: group.seconds[kind] - before[kind] for kind in group.seconds}
        row.update({f"{kind}_share": round(spent[kind] / seconds, 3) for kind in ("all_reduce", "all_gather", "broadcast")})
        row["collective_share"] = round(sum(spent.values()) / seconds, 3)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama-90m")
    ap.add_argument("--model-dir", type=Path, default=None, help="a model directory instead of the preset's")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="runs per row; the best is reported")
    args = ap.parse_args(argv)
    model_dir = args.model_dir or Path.home() / ".cache" / "pagedserve" / f"bench-{args.preset}"
    if args.model_dir is None and not (model_dir / "config.json").exists():
        build_model(model_dir, "llama", **PRESETS[args.preset], seed=0, dtype=args.dtype)
    rows = []
    for name, tp, stack in (("TP=1", 1, True), ("TP=1, no C decode stack", 1, False), ("TP=2", 2, False)):
        llm = LLM(model_dir, dtype=args.dtype, tensor_parallel_size=tp)
        if not stack:
            llm.engine.runner.model.native_stack = None
        for batch in (1, args.batch):
            best = max((run(llm, batch, args, seed=len(rows) * 100 + k) for k in range(args.repeats)),
                       key=lambda r: r["tokens"] / r["seconds"])
            rows.append({"config": name, "batch": batch, **best, "tok_s": round(best["tokens"] / best["seconds"], 1)})
        llm.engine.close()
    for row in rows:
        base = next(r for r in rows if r["batch"] == row["batch"])
        row["vs_tp1"] = round(row["tok_s"] / base["tok_s"], 2)
    print(json.dumps({"bench": "tensor_parallel", "preset": None if args.model_dir else args.preset, "dtype": args.dtype, "prompt_len": args.prompt_len,
                      "max_tokens": args.max_tokens, "results": rows}))
    columns = ("config", "batch", "tokens", "seconds", "tok_s", "vs_tp1", "collective_share", "all_reduce_share",
               "all_gather_share", "broadcast_share")
    print_table(rows, [(k, lambda r, k=k: r.get(k, "")) for k in columns])
    return 0


if __name__ == "__main__":
    sys.exit(main())
