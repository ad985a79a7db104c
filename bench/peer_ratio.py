"""pagedserve against its peers on the peers' workload, as a ratio from one sitting.

Runs pagedserve's ``LLM.generate`` on workload W64 (64 requests, ``random.Random(0)``: prompt and
output lengths ``randint(32, 256)``, prompt ids ``randint(4, vocab - 1)``, greedy, EOS ignored:
the definition in ``../shared/peers/workload.py``) and divides its output tokens/s by those of the
peers' JSON lines (``bench_vllm.py``, ``bench_hf.py``) run just before it on the same machine.
Never run two benchmarks at once: on two cores they slow each other down.

    PEERS=/scratch/peers
    $PEERS/vllm/bin/python $PEERS/bench_vllm.py --model $PEERS/models/llama-med --dtype bfloat16 --results peers.jsonl
    python -m bench.peer_ratio --model $PEERS/models/llama-med --dtype bfloat16 --peer-json peers.jsonl

Prints one JSON line and a table. Like ``bench_vllm.py``: a warm-up first, then ``--repeats``
timed passes (the prefix cache emptied before each), the median reported.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from pagedserve.bench.table import print_table
from pagedserve.kernels.backends import KV_CACHE_DTYPES
from pagedserve.kernels.ops import BACKENDS
from pagedserve.shared.sampling import SamplingParams


def w64(vocab: int, count: int = 64, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    work = []
    for _ in range(count):
        prompt_len, out_len = rng.randint(32, 256), rng.randint(32, 256)
        work.append(([rng.randint(4, vocab - 1) for _ in range(prompt_len)], out_len))
    return work


def peer_lines(path: Path | None, model: str, dtype: str, count: int = 64) -> list[dict]:
    """The newest line per engine in ``path`` for this model, dtype and number of requests."""
    if path is None or not path.exists():
        return []
    newest: dict[str, dict] = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        requests = (rec.get("workload") or {}).get("n", 64)
        if rec.get("model") == model and str(rec.get("dtype", "")).replace("bf16", "bfloat16") == dtype and requests == count:
            newest[f"{rec.get('engine')} {rec.get('mode', '')}".strip()] = rec
    return list(newest.values())


def run_pagedserve(model: Path, dtype: str, repeats: int, eager: bool, backend: str = "auto", count: int = 64,
                   kv_cache_dtype: str = "auto", kv_cache_memory: int | None = None) -> dict:
    from pagedserve import LLM

    llm = LLM(model, dtype=dtype, max_num_seqs=64, enforce_eager=eager, attention_backend=backend,
              kv_cache_dtype=kv_cache_dtype, kv_cache_memory=kv_cache_memory)
    vocab = llm.engine.info.config.vocab_size
    work = w64(vocab, count)
    llm.generate([[5 + i] * 40 for i in range(4)], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # warm-up, with ids the timed passes do not share
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    times = []
    for _ in range(repeats):
        llm.engine.forget_cached()
        start = time.perf_counter()
        outs = llm.generate([p for p, _ in work], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert all(len(o.outputs[0].token_ids) == n for o, (_, n) in zip(outs, work)), "an output has the wrong length"
    return {"engine": "pagedserve", "mode": "LLM.generate", "dtype": dtype, "out_tok_s": round(tokens / seconds, 1),
            "elapsed_s": round(seconds, 2), "elapsed_all_s": [round(t, 2) for t in times], "output_tokens": tokens,
            "enforce_eager": eager, "attention_backend": llm.engine.runner.ops.backend, "num_requests": count,
            "kv_cache_dtype": kv_cache_dtype, "kv_cache_memory": kv_cache_memory,
            "preemptions_per_pass": llm.engine.stats()["num_preemptions_total"] // repeats}  # the warm-up preempts nothing


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path,
                    help="the peers' model folder, e.g. $PEERS/models/llama-med, or a .gguf file (the real default model)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--peer-json", type=Path, help="JSON lines of bench_vllm.py / bench_hf.py from this sitting")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--attention-backend", default="auto", choices=BACKENDS)
    ap.add_argument("--num-requests", type=int, default=64,
                    help="the first N requests of W64 (bench_vllm.py --num-requests N runs the same ones)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    ap.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV pool (default: what fits)")
    args = ap.parse_args(argv)
    ours = run_pagedserve(args.model, args.dtype, args.repeats, args.enforce_eager, args.attention_backend,
                          args.num_requests, args.kv_cache_dtype, args.kv_cache_memory)
    peers = peer_lines(args.peer_json, args.model.name, args.dtype, args.num_requests)
    ratios = {f"{p['engine']} {p.get('mode', '')}".strip(): round(ours["out_tok_s"] / p["out_tok_s"], 2) for p in peers}
    print(json.dumps({"bench": "peer_ratio", "model": args.model.name, **ours, "ratio_to": ratios}))
    rows = [ours, *peers]
    print_table(rows, [("engine", lambda r: f"{r['engine']} {r.get('mode', '')}".strip()), ("dtype", lambda r: r["dtype"]),
                       ("out tok/s", lambda r: r["out_tok_s"]),
                       ("pagedserve / this", lambda r: round(ours["out_tok_s"] / r["out_tok_s"], 2))])
    return 0


if __name__ == "__main__":
    sys.exit(main())
