"""Prefill attention on the CPU: one prompt of each length as one chunk (causal over itself), GQA 9/3
with heads of 64 (SmolLM2's shape), the C kernel (``paged_kernels/csrc/paged_prefill.c``: tiles of a
chunk's tokens) against the torch reference (gather, then masked attention), and torch's own flash
attention on the same K/V laid out contiguously (no paging: a floor, not a backend). Median of
``--repeats`` calls, milliseconds per layer; one whole prefill is that times the layers.

    python -m pagedserve.bench.prefill_attention [--lengths 512 1024 2048] [--dtype float32] [--repeats 10]
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

from pagedserve.bench.kv_decode import DIM, HEADS, KV_HEADS, caches
from pagedserve.bench.table import print_table
from pagedserve.kernels.kv_format import kv_format
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
    q = torch.randn(length, HEADS, DIM).to(dtype)
    starts = torch.tensor([0, length], dtype=torch.int32)
    lens = torch.tensor([length], dtype=torch.int32)
    result = {"tokens": length}
    for backend in ("native", "torch"):
        ops = select_ops(device, backend, kernel_cache, kv_format("auto"))
        k, v, tables = caches(ops, 1, length, dtype, device)
        result[f"{backend}_ms"] = median_ms(lambda: ops.prefill(q, k, v, tables, starts, lens, 0.125, max_query_len=length,
                                                               max_seq_len=length), repeats)
    dense = [torch.randn(1, heads, length, DIM).to(dtype) for heads in (HEADS, KV_HEADS, KV_HEADS)]
    result["flash_contiguous_ms"] = median_ms(
        lambda: F.scaled_dot_product_attention(*dense, is_causal=True, enable_gqa=True), repeats)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
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
