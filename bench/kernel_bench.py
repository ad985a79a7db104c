"""Decode and prefill attention kernels: time, achieved bandwidth, and ratios to baselines on the same data.

For each (batch, context): the Triton paged decode kernel (and, where it cuts the context finer than
slices of 512 tokens, the same launch in slices of 512); torch SDPA over the same K/V gathered into
contiguous tensors (gather not timed); and the device's copy bandwidth (a large device-to-device
copy). Bandwidth counts the KV bytes the kernel must read.

    python bench/kernel_bench.py [--out results.json]            # on a CUDA machine
    TRITON_INTERPRET=1 python bench/kernel_bench.py --quick       # smoke run on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.nn import functional as F

from pagedserve.bench.table import print_table
from pagedserve.kernels.decode_partitions import PARTITIONS, decode_partition

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def timed(fn, device: str, repeat: int) -> float:
    """Median seconds of ``fn``."""
    fn()
    times = []
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: str, repeat: int) -> float:
    """Bytes/s of a 1 GiB (256 MiB on CPU) device copy, counting read + write."""
    n = (1 << 30 if device == "cuda" else 1 << 28) // 4
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    return 2 * n * 4 / timed(lambda: dst.copy_(src), device, repeat)


def one_case(batch: int, context: int, dtype: torch.dtype, device: str, repeat: int) -> dict:
    from pagedserve.kernels.paged_attention import paged_attention_decode
    from pagedserve.kernels.reference import gather_context

    blocks_per_seq = -(-context // BLOCK)
    k_cache = torch.randn(batch * blocks_per_seq, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * blocks_per_seq, device=device).view(batch, blocks_per_seq).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=dtype)
    scale = HEAD_DIM**-0.5
    def decode(partition: int | None = None):
        return paged_attention_decode(q, k_cache, v_cache, tables, lens, scale, max_seq_len=context, partition=partition)

    t_kernel = timed(decode, device, repeat)
    k = gather_context(k_cache, tables, context).transpose(1, 2).contiguous()
    v = gather_context(v_cache, tables, context).transpose(1, 2).contiguous()
    t_sdpa = timed(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True), device, repeat)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size()
    partition = decode_partition(batch, KV_HEADS, context)
    row = {"batch": batch, "context": context, "partition": partition, "kernel_ms": round(t_kernel * 1e3, 4),
           "sdpa_ms": round(t_sdpa * 1e3, 4), "kernel_gbps": round(kv_bytes / t_kernel / 1e9, 1),
           "kernel_vs_sdpa": round(t_sdpa / t_kernel, 3)}
    if partition != PARTITIONS[0]:  # cut finer for a few long sequences: against the slices of 512 in the same run
        row["vs_slices_of_512"] = round(timed(lambda: decode(PARTITIONS[0]), device, repeat) / t_kernel, 3)
    return row


def prefill_case(seqs: int, length: int, dtype: torch.dtype, device: str, repeat: int) -> dict:
    """The Triton prefill kernel on ``seqs`` whole prompts of ``length`` tokens (causal, one chunk
    each) against torch SDPA's causal attention over the same K/V laid out contiguously."""
    from pagedserve.kernels.prefill_attention import prefill_attention

    blocks = -(-length // BLOCK)
    k_cache = torch.randn(seqs * blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(seqs * blocks, device=device, dtype=torch.int32).view(seqs, blocks)
    lens = torch.full((seqs,), length, dtype=torch.int32, device=device)
    starts = torch.arange(seqs + 1, device=device, dtype=torch.int32) * length
    q = torch.randn(seqs * length, HEADS, HEAD_DIM, device=device, dtype=dtype)
    scale = HEAD_DIM**-0.5
    t_kernel = timed(lambda: prefill_attention(q, k_cache, v_cache, tables, starts, lens, scale, max_query_len=length),
                     device, repeat)
    k = k_cache.view(seqs, blocks * BLOCK, KV_HEADS, HEAD_DIM)[:, :length].transpose(1, 2).contiguous()
    v = v_cache.view(seqs, blocks * BLOCK, KV_HEADS, HEAD_DIM)[:, :length].transpose(1, 2).contiguous()
    qs = q.view(seqs, length, HEADS, HEAD_DIM).transpose(1, 2)
    t_sdpa = timed(lambda: F.scaled_dot_product_attention(qs, k, v, scale=scale, is_causal=True, enable_gqa=True),
                   device, repeat)
    flops = 4 * seqs * HEADS * HEAD_DIM * length * length / 2  # causal: half the square, two products
    return {"seqs": seqs, "length": length, "kernel_ms": round(t_kernel * 1e3, 4), "sdpa_ms": round(t_sdpa * 1e3, 4),
            "kernel_tflops": round(flops / t_kernel / 1e12, 1), "kernel_vs_sdpa": round(t_sdpa / t_kernel, 3)}


def kernel_resources() -> list[dict]:
    """Registers, spills and shared memory of every Triton kernel variant compiled so far in this
    process (read from Triton's per-device caches; an entry says why where they cannot be read)."""
    from pagedserve.kernels import copy_blocks, paged_attention, prefill_attention, store_kv

    rows: list[dict] = []
    for module in (paged_attention, prefill_attention, store_kv, copy_blocks):
        for name, fn in vars(module).items():
            for caches in getattr(fn, "device_caches", {}).values():
                for compiled in caches[0].values():
                    try:
                        compiled._init_handles()
                        rows.append({"kernel": name, "regs": compiled.n_regs, "spills": compiled.n_spills,
                                     "shared": compiled.metadata.shared, "warps": compiled.metadata.num_warps})
                    except Exception as err:  # noqa: BLE001 - the report says what could not be read
                        rows.append({"kernel": name, "error": f"{type(err).__name__}: {err}"})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny grid (CPU interpreter smoke run)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("bench.kernel_bench times the Triton kernels, which need a CUDA GPU. On a CPU: "
              "TRITON_INTERPRET=1 python -m bench.kernel_bench --quick (a smoke run, not a measurement); "
              "the CPU kernel's figures come from python -m bench.peer_ratio (docs/benchmarks.md).", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    if args.quick:
        grid, repeat = [(1, 128), (2, 600)], 1
    else:
        grid, repeat = [(b, c) for b in (1, 8, 32, 128, 256) for c in (128, 1024, 4096, 16384, 32768) if b * c <= 1 << 22], 20
    copy_bw = copy_bandwidth(device, repeat)
    rows = [one_case(b, c, dtype, device, repeat) for b, c in grid]
    for r in rows:
        r["fraction_of_copy_bw"] = round(r["kernel_gbps"] * 1e9 / copy_bw, 3)
    prefill_grid = [(1, 512)] if args.quick else [(16, 512), (4, 2048), (1, 8192)]
    prefill = [prefill_case(s, n, dtype, device, repeat) for s, n in prefill_grid]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    result = {"bench": "kernel_decode", "device": name, "dtype": args.dtype, "copy_gbps": round(copy_bw / 1e9, 1),
              "results": rows, "prefill": prefill, "kernels": kernel_resources() if device == "cuda" else []}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print_table(rows, [("batch", lambda r: r["batch"]), ("context", lambda r: r["context"]),
                       ("slice", lambda r: r["partition"]), ("vs 512", lambda r: r.get("vs_slices_of_512", "")),
                       ("kernel ms", lambda r: r["kernel_ms"]), ("GB/s", lambda r: r["kernel_gbps"]),
                       ("of copy", lambda r: f"{r['fraction_of_copy_bw']:.1%}"), ("sdpa ms", lambda r: r["sdpa_ms"]),
                       ("vs sdpa", lambda r: f"{r['kernel_vs_sdpa']}x")])
    print_table(prefill, [("prompts", lambda r: r["seqs"]), ("length", lambda r: r["length"]),
                          ("prefill ms", lambda r: r["kernel_ms"]), ("TFLOP/s", lambda r: r["kernel_tflops"]),
                          ("sdpa ms", lambda r: r["sdpa_ms"]), ("vs sdpa", lambda r: f"{r['kernel_vs_sdpa']}x")])
    spilled = [k for k in result["kernels"] if k.get("spills")]
    print(f"kernel variants compiled: {len(result['kernels'])}, with spills: {spilled or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
