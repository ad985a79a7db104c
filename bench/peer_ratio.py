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
from pagedserve.kernels.backends import KV_CACHE_DTYPES, QUANTIZATIONS
from pagedserve.kernels.ops import BACKENDS
from pagedserve.shared.sampling import SamplingParams


W64 = (64, 0, 32, 256, 32, 256)  # n, seed, prompt min/max, output min/max: bench_llamacpp.py --wl's fields


def workload(vocab: int, spec: tuple[int, ...] = W64) -> list[tuple[list[int], int]]:
    """``../shared/peers/workload.py``'s requests: ``spec`` as ``bench_llamacpp.py --wl`` reads it."""
    count, seed, pmin, pmax, omin, omax = spec
    rng = random.Random(seed)
    work = []
    for _ in range(count):
        prompt_len, out_len = rng.randint(pmin, pmax), rng.randint(omin, omax)
        work.append(([rng.randint(4, vocab - 1) for _ in range(prompt_len)], out_len))
    return work


def w64(vocab: int, count: int = 64, seed: int = 0) -> list[tuple[list[int], int]]:
    return workload(vocab, (count, seed, *W64[2:]))


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


def run_pagedserve(model: Path, dtype: str, repeats: int, work_spec: tuple[int, ...] = W64,
                   one_at_a_time: bool = False, **engine) -> dict:
    """``engine``: LLM options (enforce_eager, attention_backend, kv_cache_dtype, quantization, ...).
    ``one_at_a_time``: each request generated alone, one stream (as ``bench_llamacpp.py --parallel 1``)."""
    from pagedserve import LLM

    llm = LLM(model, dtype=dtype, max_num_seqs=64, **engine)
    work = workload(llm.engine.info.config.vocab_size, work_spec)
    llm.generate([[5 + i] * 40 for i in range(4)], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # warm-up, with ids the timed passes do not share
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in work]
    batches = [[i] for i in range(len(work))] if one_at_a_time else [list(range(len(work)))]
    times = []
    for _ in range(repeats):
        llm.engine.forget_cached()
        start = time.perf_counter()
        outs = [out for batch in batches for out in llm.generate([work[i][0] for i in batch], [params[i] for i in batch],
                                                                 use_tqdm=False)]
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert all(len(o.outputs[0].token_ids) == n for o, (_, n) in zip(outs, work)), "an output has the wrong length"
    return {"engine": "pagedserve", "mode": "LLM.generate" + (", one at a time" if one_at_a_time else ""), "dtype": dtype,
            "out_tok_s": round(tokens / seconds, 1), "elapsed_s": round(seconds, 2),
            "elapsed_all_s": [round(t, 2) for t in times], "output_tokens": tokens, "num_requests": len(work),
            "workload": ",".join(map(str, work_spec)), "attention_backend": llm.engine.runner.ops.backend, **engine,
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
    ap.add_argument("--quantization", default="auto", choices=QUANTIZATIONS)
    ap.add_argument("--gguf-activations", default="int16", choices=["int16", "int8"])
    ap.add_argument("--wl", default=None, help="n,seed,pmin,pmax,omin,omax as bench_llamacpp.py --wl (default: W64)")
    ap.add_argument("--one-at-a-time", action="store_true", help="one request at a time (bench_llamacpp.py --parallel 1)")
    ap.add_argument("--max-step-ms", type=float, default=None, help="the engine's step target (default: the LLM's, off)")
    args = ap.parse_args(argv)
    spec = tuple(int(x) for x in args.wl.split(",")) if args.wl else (args.num_requests, *W64[1:])
    if len(spec) != 6:
        ap.error(f"--wl takes six comma-separated integers, got {args.wl!r}")
    ours = run_pagedserve(args.model, args.dtype, args.repeats, spec, args.one_at_a_time, enforce_eager=args.enforce_eager,
                          attention_backend=args.attention_backend, kv_cache_dtype=args.kv_cache_dtype,
                          kv_cache_memory=args.kv_cache_memory, quantization=args.quantization,
                          gguf_activations=args.gguf_activations, max_step_ms=args.max_step_ms)
    peers = peer_lines(args.peer_json, args.model.name, args.dtype, spec[0])
    ratios = {f"{p['engine']} {p.get('mode', '')}".strip(): round(ours["out_tok_s"] / p["out_tok_s"], 2) for p in peers}
    print(json.dumps({"bench": "peer_ratio", "model": args.model.name, **ours, "ratio_to": ratios}))
    rows = [ours, *peers]
    print_table(rows, [("engine", lambda r: f"{r['engine']} {r.get('mode', '')}".strip()), ("dtype", lambda r: r["dtype"]),
                       ("out tok/s", lambda r: r["out_tok_s"]),
                       ("pagedserve / this", lambda r: round(ours["out_tok_s"] / r["out_tok_s"], 2))])
    return 0


if __name__ == "__main__":
    sys.exit(main())
