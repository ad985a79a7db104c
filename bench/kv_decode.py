"""The decode step's attention over an 8-bit KV cache against the model-dtype one, on the CPU's C
kernel (``--backend native``) or the Triton kernel on CUDA (``--backend triton --device cuda``): 32
sequences at each context length, GQA 9/3 with heads of 64 (SmolLM2's shape; ``--heads 32 --kv-heads
8 --head-dim 128``: Llama-3-8B's), the median of ``--repeats`` calls. An 8-bit cache reads a quarter
(float32) or half (bfloat16) of the bytes; the codes are decoded inside the kernel's loop, or on
Triton also multiplied as stored (``*_products``: ``--quantized-products``, queries and
probabilities quantized to the cache's codes).

    python -m pagedserve.bench.kv_decode [--contexts 64 1024 4096] [--dtype float32] [--backend native] [--device cpu]
        [--heads 9 --kv-heads 3 --head-dim 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagedserve.bench.table import print_table
from pagedserve.kernels.kv_format import kv_format
from pagedserve.kernels.ops import AttentionOps, select_ops

BLOCK = 16
SPEEDUPS = {"fp8_e4m3": "fp8", "fp8_e4m3_products": "fp8_products"}  # speedup columns named unlike their format


@dataclass(frozen=True)
class Heads:
    query: int
    kv: int
    dim: int


SMOLLM2 = Heads(9, 3, 64)  # the default shape (the first device run's)


def caches(ops: AttentionOps, heads: Heads, seqs: int, context: int, dtype: torch.dtype, device: torch.device):
    """K/V caches holding ``seqs`` contexts of ``context`` tokens (stored through ``store_kv``)."""
    fmt = ops.kv_format
    blocks = seqs * -(-context // BLOCK)
    shape = (blocks, BLOCK, heads.kv, fmt.row_width(heads.dim))
    k, v = (torch.zeros(shape, dtype=fmt.storage_dtype(dtype), device=device) for _ in range(2))
    gen = torch.Generator(device="cpu").manual_seed(0)
    values = torch.randn(blocks * BLOCK, heads.kv, heads.dim, generator=gen, device="cpu").to(dtype).to(device)
    ops.store_kv(values, values, k, v, torch.arange(blocks * BLOCK, device=device))
    tables = torch.arange(blocks, dtype=torch.int32, device=device).view(seqs, -1)
    return k, v, tables


def time_decode(ops: AttentionOps, heads: Heads, seqs: int, context: int, dtype: torch.dtype, device: torch.device,
                repeats: int) -> float:
    k, v, tables = caches(ops, heads, seqs, context, dtype, device)
    q = torch.randn(seqs, heads.query, heads.dim, device="cpu").to(dtype).to(device)
    lens = torch.full((seqs,), context, dtype=torch.int32, device=device)
    ops.decode(q, k, v, tables, lens, 0.125, max_seq_len=context)  # warm-up (and the Triton compile)
    times = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        ops.decode(q, k, v, tables, lens, 0.125, max_seq_len=context)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 1024, 4096])
    ap.add_argument("--seqs", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--backend", default="native", choices=["native", "triton"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--heads", type=int, default=SMOLLM2.query, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=SMOLLM2.kv)
    ap.add_argument("--head-dim", type=int, default=SMOLLM2.dim)
    args = ap.parse_args(argv)
    heads = Heads(args.heads, args.kv_heads, args.head_dim)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    folder = Path(tempfile.gettempdir()) / "pagedserve-kernels"
    formats = {name: kv_format(name, device) for name in ("auto", "int8", "fp8_e4m3")}
    if args.backend == "triton":  # the codes multiplied as stored (paged_kernels/quantized_products.py)
        formats |= {f"{name}_products": kv_format(name, device, quantized_products=True)
                    for name in ("int8", "fp8_e4m3")}
    kernels = {name: select_ops(device, args.backend, folder, fmt) for name, fmt in formats.items()}
    rows = []
    for context in args.contexts:
        ms = {name: time_decode(ops, heads, args.seqs, context, dtype, device, args.repeats)
              for name, ops in kernels.items()}
        rows.append({"context": context, **{f"{name}_ms": round(t, 3) for name, t in ms.items()},
                     **{f"{SPEEDUPS.get(name, name)}_speedup": round(ms["auto"] / t, 2) for name, t in ms.items()
                        if name != "auto"}})
    print(json.dumps({"bench": "kv_decode", "backend": args.backend, "device": args.device, "dtype": args.dtype,
                      "heads": asdict(heads), "seqs": args.seqs, "threads": torch.get_num_threads(), "results": rows}))
    print_table(rows, [(k, lambda r, k=k: r[k]) for k in rows[0]])
    return 0


if __name__ == "__main__":
    sys.exit(main())
