"""The decode step's attention over an 8-bit KV cache against the model-dtype one, on the CPU's C
kernel: 32 sequences at each context length, GQA 9/3 with heads of 64 (SmolLM2's shape), the
median of ``--repeats`` calls. An 8-bit cache reads a quarter (float32) or half (bfloat16) of the
bytes; the codes are decoded through a table inside the loop.

    python -m pagedserve.bench.kv_decode [--contexts 64 1024 4096] [--dtype float32]
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

from pagedserve.bench.table import print_table
from pagedserve.kernels import reference
from pagedserve.kernels.kv_format import kv_format
from pagedserve.kernels.native_attention import NativeAttention

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16


def caches(name: str, seqs: int, context: int, dtype: torch.dtype):
    """K/V caches holding ``seqs`` contexts of ``context`` tokens (stored through ``store_kv``)."""
    fmt = kv_format(name)
    blocks = seqs * -(-context // BLOCK)
    shape = (blocks, BLOCK, KV_HEADS, fmt.row_width(DIM))
    k, v = (torch.zeros(shape, dtype=fmt.storage_dtype(dtype)) for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(blocks * BLOCK, KV_HEADS, DIM, generator=gen).to(dtype)
    reference.store_kv(values, values, k, v, torch.arange(blocks * BLOCK), kv_format=fmt)
    tables = torch.arange(blocks, dtype=torch.int32).view(seqs, -1)
    return k, v, tables


def time_decode(kernel: NativeAttention, name: str, seqs: int, context: int, dtype: torch.dtype, repeats: int) -> float:
    k, v, tables = caches(name, seqs, context, dtype)
    q = torch.randn(seqs, HEADS, DIM).to(dtype)
    lens = torch.full((seqs,), context, dtype=torch.int32)
    assert kernel.supports(q, k)
    kernel.decode(q, k, v, tables, lens, 0.125)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        kernel.decode(q, k, v, tables, lens, 0.125)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 1024, 4096])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    folder = Path(tempfile.gettempdir()) / "pagedserve-kernels"
    kernels = {name: NativeAttention(folder, kv_format(name)) for name in ("auto", "int8", "fp8_e4m3")}
    rows = []
    for context in args.contexts:
        ms = {name: time_decode(kernel, name, args.seqs, context, dtype, args.repeats) for name, kernel in kernels.items()}
        rows.append({"context": context, **{f"{name}_ms": round(t, 3) for name, t in ms.items()},
                     "int8_speedup": round(ms["auto"] / ms["int8"], 2), "fp8_speedup": round(ms["auto"] / ms["fp8_e4m3"], 2)})
    print(json.dumps({"bench": "kv_decode", "dtype": args.dtype, "seqs": args.seqs, "threads": torch.get_num_threads(),
                      "results": rows}))
    print_table(rows, [(k, lambda r, k=k: r[k]) for k in rows[0]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
