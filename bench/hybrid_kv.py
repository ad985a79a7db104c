"""The hybrid KV cache on a hybrid-attention model (Gemma 3 270M: 15 sliding layers of 512, 3 full),
against one table for every layer (``--no-hybrid-kv-cache``, the cache before lanes):

1. **One long sequence, the real model**: a prompt of ``--context`` - ``--decode`` tokens, then
   ``--decode`` greedy tokens; the KV bytes the sequence holds at its end and at its peak (a prefill
   chunk's blocks are held until the step that computed them ends), and its tokens/s.
2. **Conversations where memory binds, the real scheduler**: ``--conversations`` requests of
   ``--context`` tokens each under one KV budget in bytes (``--budget-sequences`` full-length
   sequences of the one-table layout), every request admitted at once; the scheduler and block
   manager run with the model's lanes (no forward: the KV bookkeeping does not depend on the
   token values). Peak concurrent sequences, preemptions, and steps to finish.
3. With ``--served CONTEXT CONVERSATIONS``, **that workload on the real model** (a quarter of each
   conversation output): wall time, output tokens/s, preemptions.
4. **A step's CPU time**: ``--step-rows`` sequences at each of ``--step-contexts`` tokens, decoding:
   the scheduler's ``schedule`` + ``update`` and the runner's input tensors, medians of 20 steps.

Prints one JSON line per configuration and a table.

    python -m pagedserve.bench.hybrid_kv [--model gemma-3-270m-q4_k_m] [--context 8192] [--decode 64]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pagedserve.bench.table import print_table
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.scheduling.config import SchedulerConfig
from pagedserve.worker.core.scheduling.plan import SampledToken, StepResult
from pagedserve.worker.core.scheduling.scheduler import Scheduler

BLOCK = 16
CHUNK = 2048


def one_table_budget(model: str, dtype: str, context: int, budget_sequences: int):
    """``(info, bytes of one layer's K and V per token, the budget)``: ``budget_sequences`` sequences
    of ``context`` tokens in the one-table layout (every layer, every position)."""
    from pagedserve.worker.runner.loader import inspect_model

    info = inspect_model(model, dtype)
    config = info.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layer_token_bytes = 2 * config.num_key_value_heads * head_dim * info.dtype.itemsize
    return info, layer_token_bytes, budget_sequences * context * config.num_hidden_layers * layer_token_bytes


def one_sequence(model: str, hybrid: bool, context: int, decode: int, dtype: str) -> dict:
    from pagedserve import LLM

    llm = LLM(model, device="cpu", dtype=dtype, block_size=BLOCK, max_num_batched_tokens=CHUNK,
              max_model_len=context, kv_cache_memory=3 << 30, hybrid_kv_cache=hybrid)
    engine = llm.engine
    block_bytes = engine.kv_bytes_per_token * BLOCK
    rng = random.Random(0)
    prompt = [rng.randint(1000, 200_000) for _ in range(context - decode)]
    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=decode, ignore_eos=True))
    peak = last = 0
    started = time.perf_counter()
    first_token = None
    while engine.has_unfinished():
        outputs = engine.step()
        used = engine.kv_snapshot()["figures"]["used"]
        peak = max(peak, used)
        if engine.has_unfinished():
            last = used
        if first_token is None and any(out.outputs[0].token_ids for out in outputs):
            first_token = time.perf_counter()
    done = time.perf_counter()
    return {"bench": "hybrid_kv_one_sequence", "layout": "per-lane" if hybrid else "one table", "context": context,
            "lanes": engine.runner.model.kv_layout.num_lanes, "block_bytes": block_bytes,
            "held_mib": round(last * block_bytes / 2**20, 1), "peak_mib": round(peak * block_bytes / 2**20, 1),
            "prefill_s": round(first_token - started, 2), "decode_tok_s": round((decode - 1) / (done - first_token), 2)}


def conversations(model: str, hybrid: bool, context: int, count: int, budget_sequences: int, dtype: str) -> dict:
    from pagedserve.worker.runner.models.layers import kv_layout

    info, layer_token_bytes, budget = one_table_budget(model, dtype, context, budget_sequences)
    layout = kv_layout(info.config, hybrid)
    block_bytes = layout.slots * BLOCK * layer_token_bytes
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=budget // block_bytes, block_size=BLOCK, max_num_seqs=256,
                                      max_num_batched_tokens=CHUNK, max_model_len=context,
                                      lane_windows=layout.lane_windows))
    rng = random.Random(1)
    output = 256
    for i in range(count):
        sched.add(str(i), [rng.randint(1000, 200_000) for _ in range(context - output)],
                  SamplingParams(max_tokens=output, ignore_eos=True))
    steps, peak, decoding, tokens = 0, 0, 0, 0
    started = time.perf_counter()
    while sched.has_work:
        plan = sched.schedule()
        tokens += plan.num_tokens
        sched.update(plan, StepResult({s.seq_id: (SampledToken(1),) * s.num_samples for s in plan.seqs if s.num_samples}))
        steps += 1
        peak = max(peak, sum(len(r.live_seqs) for r in sched.running))
        decoding = max(decoding, sum(1 for r in sched.running for s in r.live_seqs if s.num_computed >= s.prompt_len))
    seconds = time.perf_counter() - started
    return {"bench": "hybrid_kv_conversations", "layout": "per-lane" if hybrid else "one table", "context": context,
            "conversations": count, "budget_gib": round(budget / 2**30, 2), "blocks": budget // block_bytes,
            "peak_concurrent": peak, "peak_decoding": decoding, "preemptions": sched.stats.num_preemptions, "steps": steps,
            "tokens_computed": tokens, "schedule_ms_per_step": round(1000 * seconds / steps, 2)}


def step_cpu(model: str, hybrid: bool, context: int, rows: int, dtype: str) -> dict:
    """The CPU time of one decode step's plan at ``rows`` sequences of ``context`` tokens: the
    scheduler's ``schedule`` and ``update`` and the runner's input tensors (``step_inputs``), no forward."""
    import torch

    from pagedserve.worker.runner.attention.kept_tables import KeptTables
    from pagedserve.worker.runner.attention.step_inputs import step_inputs
    from pagedserve.worker.runner.loader import inspect_model
    from pagedserve.worker.runner.models.layers import kv_layout

    layout = kv_layout(inspect_model(model, dtype).config, hybrid)
    decode = rows * context // CHUNK + 64  # tokens the first row decodes while the last is prefilled, and the 20 steps
    blocks = rows * layout.blocks_held(context + decode, BLOCK, CHUNK) + 64
    sched = Scheduler(SchedulerConfig(num_gpu_blocks=blocks, block_size=BLOCK, max_num_seqs=rows,
                                      max_num_batched_tokens=max(CHUNK, rows), max_model_len=context + decode,
                                      enable_prefix_caching=False, lane_windows=layout.lane_windows))
    for i in range(rows):  # none ends before the measured steps: every row decodes in them
        sched.add(str(i), [1000 + i] * context, SamplingParams(max_tokens=decode, ignore_eos=True))

    kept = KeptTables(layout.num_lanes)  # the runner's tables, between steps

    def step() -> tuple[float, float, int]:
        started = time.perf_counter()
        plan = sched.schedule()
        planned = time.perf_counter()
        kept.update(plan.seqs)
        step_inputs(plan.seqs, BLOCK, torch.device("cpu"), False, layout.num_lanes, kept)
        built = time.perf_counter()
        sched.update(plan, StepResult({s.seq_id: (SampledToken(1),) * s.num_samples for s in plan.seqs if s.num_samples}))
        return planned - started + time.perf_counter() - built, built - planned, len(plan.seqs)

    while any(s.num_computed < context for r in sched.running + sched.waiting for s in r.live_seqs):
        step()
    timings = [step() for _ in range(20)]
    return {"bench": "hybrid_kv_step_cpu", "layout": "per-lane" if hybrid else "one table", "context": context,
            "rows": min(t[2] for t in timings), "lanes": layout.num_lanes,
            "scheduler_ms": round(1000 * statistics.median(t[0] for t in timings), 2),
            "inputs_ms": round(1000 * statistics.median(t[1] for t in timings), 2)}


def served(model: str, hybrid: bool, context: int, count: int, budget_sequences: int, dtype: str) -> dict:
    """The real model on ``count`` conversations of ``context`` tokens (a quarter of them output)
    under a KV budget of ``budget_sequences`` full-length sequences of the one-table layout: wall
    time, output tokens/s, preemptions."""
    from pagedserve import LLM

    _, _, budget = one_table_budget(model, dtype, context, budget_sequences)
    llm = LLM(model, device="cpu", dtype=dtype, block_size=BLOCK, max_num_batched_tokens=CHUNK, max_model_len=context,
              kv_cache_memory=budget, hybrid_kv_cache=hybrid)
    rng = random.Random(2)
    output = context // 4
    prompts = [[rng.randint(1000, 200_000) for _ in range(context - output)] for _ in range(count)]
    started = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - started
    return {"bench": "hybrid_kv_served", "layout": "per-lane" if hybrid else "one table", "context": context,
            "conversations": count, "budget_mib": round(budget / 2**20), "seconds": round(seconds, 1),
            "output_tok_s": round(sum(len(o.outputs[0].token_ids) for o in outs) / seconds, 2),
            "preemptions": llm.engine.stats()["num_preemptions_total"]}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma-3-270m-q4_k_m")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--conversations", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--budget-sequences", type=int, default=4)
    parser.add_argument("--skip-model", action="store_true", help="only the scheduler's part (no forward)")
    parser.add_argument("--step-rows", type=int, default=64)
    parser.add_argument("--served", type=int, nargs=2, metavar=("CONTEXT", "CONVERSATIONS"), default=None,
                        help="also serve CONVERSATIONS of CONTEXT tokens on the real model under the budget")
    parser.add_argument("--step-contexts", type=int, nargs="+", default=[2048, 8192])
    return parser.parse_args()


def measure(args: argparse.Namespace, hybrid: bool):
    """Each measurement the arguments ask for, in one layout, as it ends."""
    if not args.skip_model:
        yield one_sequence(args.model, hybrid, args.context, args.decode, args.dtype)
    for count in args.conversations:
        yield conversations(args.model, hybrid, args.context, count, args.budget_sequences, args.dtype)
    if args.served:
        yield served(args.model, hybrid, *args.served, args.budget_sequences, args.dtype)
    for context in args.step_contexts:
        yield step_cpu(args.model, hybrid, context, args.step_rows, args.dtype)


TABLES = {  # bench -> its table's columns
    "hybrid_kv_one_sequence": [("layout", "layout"), ("lanes", "lanes"), ("held MiB", "held_mib"), ("peak MiB", "peak_mib"),
                               ("prefill s", "prefill_s"), ("decode tok/s", "decode_tok_s")],
    "hybrid_kv_conversations": [("layout", "layout"), ("conversations", "conversations"), ("budget GiB", "budget_gib"),
                                ("blocks", "blocks"), ("peak concurrent", "peak_concurrent"),
                                ("peak decoding", "peak_decoding"), ("preemptions", "preemptions"), ("steps", "steps"),
                                ("tokens computed", "tokens_computed"), ("schedule ms/step", "schedule_ms_per_step")],
    "hybrid_kv_served": [("layout", "layout"), ("context", "context"), ("conversations", "conversations"),
                         ("budget MiB", "budget_mib"), ("seconds", "seconds"), ("output tok/s", "output_tok_s"),
                         ("preemptions", "preemptions")],
    "hybrid_kv_step_cpu": [("layout", "layout"), ("rows", "rows"), ("context", "context"), ("lanes", "lanes"),
                           ("scheduler ms", "scheduler_ms"), ("input tensors ms", "inputs_ms")],
}


def main() -> None:
    args = parse_args()
    rows = []
    for hybrid in (False, True):
        for row in measure(args, hybrid):
            rows.append(row)
            print(json.dumps(row), flush=True)
    for bench, columns in TABLES.items():
        picked = [r for r in rows if r["bench"] == bench]
        if picked:
            print_table(picked, [(title, lambda r, key=key: r[key]) for title, key in columns])


if __name__ == "__main__":
    main()
