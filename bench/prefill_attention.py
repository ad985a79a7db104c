"""Prefill attention on the CPU: one prompt of each length as one chunk (causal over itself), GQA 9/3
with heads of 64 (SmolLM2's shape), the C kernel (``paged_kernels/csrc/paged_prefill.c``: tiles of a
chunk's tokens) against the torch reference (gather, then masked attention), and torch's own flash
attention on the same K/V laid out contiguously (no paging: a floor, not a backend). Median of
``--repeats`` calls, milliseconds per layer; one whole prefill is that times the layers.

``--chunks TOKENS@CONTEXT ...`` times bfloat16 chunks of a prompt instead (the chunk's tokens after
``CONTEXT`` cached ones, as a step's chunk of a long prompt): the kernel this CPU runs for bfloat16
(pair products on AMX tiles or AVX512-BF16 vectors where it has them, ``csrc/paged_prefill_bf16.c``)
against the vector kernel, with nanoseconds per query-key pair.

    python -m pagedserve.bench.prefill_attention [--lengths 512 1024 2048] [--dtype float32] [--repeats 10]
    python -m pagedserve.bench.prefill_attention --chunks 2048@0 2048@4096 60@5940
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.bench.kv_decode import SMOLLM2, caches
from pagedserve.bench.table import print_table
from pagedserve.kernels.kv_format import kv_format
from pagedserve.kernels.native_attention import NativeAttention
from pagedserve.kernels.ops import select_ops


def median_ms(call, repeats: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 2)


def row(length: int, dtype: torch.dtype, repeats: int, kernel_cache: Path) -> dict:
    device = torch.device("cpu")
    q = torch.randn(length, SMOLLM2.query, SMOLLM2.dim).to(dtype)
    starts = torch.tensor([0, length], dtype=torch.int32)
    lens = torch.tensor([length], dtype=torch.int32)
    result = {"tokens": length}
    for backend in ("native", "torch"):
        ops = select_ops(device, backend, kernel_cache, kv_format("auto"))
        k, v, tables = caches(ops, SMOLLM2, 1, length, dtype, device)
        result[f"{backend}_ms"] = median_ms(lambda: ops.prefill(q, k, v, tables, starts, lens, 0.125, max_query_len=length,
                                                               max_seq_len=length), repeats)
    dense = [torch.randn(1, heads, length, SMOLLM2.dim).to(dtype) for heads in (SMOLLM2.query, SMOLLM2.kv, SMOLLM2.kv)]
    result["flash_contiguous_ms"] = median_ms(
        lambda: F.scaled_dot_product_attention(*dense, is_causal=True, enable_gqa=True), repeats)
    return result


def chunk_row(spec: str, repeats: int, kernel_cache: Path) -> dict:
    """A bfloat16 chunk ``TOKENS@CONTEXT``: the pair-product kernel against the vector kernel."""
    tokens, context = (int(part) for part in spec.split("@"))
    ops = select_ops(torch.device("cpu"), "native", kernel_cache, kv_format("auto"))
    k, v, tables = caches(ops, SMOLLM2, 1, context + tokens, torch.bfloat16, torch.device("cpu"))
    q = torch.randn(tokens, SMOLLM2.query, SMOLLM2.dim).to(torch.bfloat16)
    starts = torch.tensor([0, tokens], dtype=torch.int32)
    lens = torch.tensor([context + tokens], dtype=torch.int32)
    pairs = tokens * context + tokens * (tokens + 1) // 2  # the query-key pairs the chunk attends
    result = {"tokens": tokens, "context": context}
    for name, pair_products in (("pairs", True), ("vector", False)):
        attention = NativeAttention(kernel_cache, pair_products=pair_products)
        result[f"{name}_kernel"] = attention.prefill_kind
        ms = median_ms(lambda: attention.prefill(q, k, v, tables, starts, lens, 0.125), repeats)
        result[f"{name}_ms"], result[f"{name}_ns_per_pair"] = ms, round(ms * 1e6 / pairs, 2)
    result["speedup"] = round(result["vector_ms"] / result["pairs_ms"], 2)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--chunks", nargs="+", metavar="TOKENS@CONTEXT",
                    help="bfloat16 chunks at a context: the pair-product kernel against the vector kernel")
    args = ap.parse_args(argv)
    if args.chunks:
        with tempfile.TemporaryDirectory() as cache:
            rows = [chunk_row(spec, args.repeats, Path(cache)) for spec in args.chunks]
        print(json.dumps({"bench": "prefill_chunks", "threads": torch.get_num_threads(), "results": rows}))
        print_table(rows, [(key, lambda r, key=key: r[key]) for key in
                           ("tokens", "context", "pairs_kernel", "pairs_ms", "vector_ms", "pairs_ns_per_pair",
                            "vector_ns_per_pair", "speedup")])
        return 0
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as cache:
        rows = [row(length, dtype, args.repeats, Path(cache)) for length in args.lengths]
    print(json.dumps({"bench": "prefill_attention", "dtype": args.dtype, "threads": torch.get_num_threads(),
                      "results": rows}))
    print_table(rows, [(key, lambda r, key=key: r[key])
                       for key in ("tokens", "native_ms", "torch_ms", "flash_contiguous_ms")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
