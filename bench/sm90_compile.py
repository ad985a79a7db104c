"""The Triton kernels compiled for Hopper (sm_90) on a machine without a GPU: for each kernel at
the head shapes of real models, its registers, stack and shared memory (from the cubin, with the
``cuobjdump`` Triton bundles), spills inside a loop (from its machine code), the shapes of its
wgmma products and its asynchronous copies (from its PTX). Compiled as a launch specializes it
(aligned pointers and strides). tests/kernels/test_register_budget.py holds every case to its
budget; this prints them.

    python -m pagedserve.bench.sm90_compile [--only prefill-long-auto]   # a JSON line, then a table
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import triton

from pagedserve.bench.table import print_table
from pagedserve.kernels import lora_update, paged_attention, prefill_attention
from pagedserve.kernels.decode_partitions import decode_tile
from pagedserve.kernels.kv_format import kv_format
from pagedserve.kernels.paged_tiles import code_constants, dot_pad

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
MODELS = {  # (query heads per KV head, head_dim)
    "Llama-3-8B": (4, 128), "Llama-3-70B": (8, 128), "Qwen2.5-7B": (7, 128), "Gemma-2-9B": (2, 256),
    "Gemma-3-1B": (4, 256), "SmolLM2-135M": (3, 64),
}  # Mistral-7B's heads are Llama-3-8B's: the same compiles
SOFT_CAPPED = ("Gemma-2-9B",)  # its attention kernels are compiled with soft-capping
POINTERS = {"tables_ptr": "*i32", "lens_ptr": "*i32", "starts_ptr": "*i32", "slot_ptr": "*i32"}
ALIGNED_STRIDES = ("stride_qs", "stride_qh", "stride_qt", "stride_ot", "stride_oh", "stride_os")
CACHE_STRIDES = ("stride_kb", "stride_kt", "stride_kh")


def resources(fn, cache_dtype: str, constexprs: dict, num_warps: int, rows_aligned: bool = True) -> dict:
    """``REG``, ``STACK``, ... of ``fn`` compiled for sm_90 with a cache of ``cache_dtype``, and from its
    PTX the shapes of its wgmma products and its count of asynchronous copies (loads pipelined
    through shared memory). Compiled as a launch specializes it: pointers and the strides of
    queries, outputs and, where ``rows_aligned`` (a 16-bit cache, or CUDA's 8-bit rows of a head a
    multiple of 16: ``kv_format.ALIGNED_TAIL``), the cache's."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            continue
        if name.endswith("_ptr"):
            signature[name] = POINTERS.get(name, f"*{cache_dtype}" if name in ("k_ptr", "v_ptr") else
                                           "*bf16" if name in ("q_ptr", "out_ptr") else "*fp32")
        else:
            signature[name] = "fp32" if name in ("scale", "softcap") else "i64" if name.startswith("stride") else "i32"
    aligned = [n for n in signature if n.endswith("_ptr") or n in ALIGNED_STRIDES
               or (n in CACHE_STRIDES and rows_aligned)]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([CUOBJDUMP, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([CUOBJDUMP, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    line = next(text for text in usage.splitlines() if "REG:" in text)
    ptx = compiled.asm["ptx"]
    return {**{key: int(value) for key, value in re.findall(r"([A-Z]+):(\d+)", line)},
            "local_in_loops": local_in_loops(sass), "loop_instructions": len(in_loops(sass)),
            "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", ptx))),
            "async_copies": len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx))}


def in_loops(sass: str) -> list[str]:
    """The instructions inside a loop of the kernel's machine code: between a backward branch's
    target and the branch (what runs once a tile)."""
    instructions = [(int(at, 16), text) for at, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(target, 16), at) for at, text in instructions
             for target in re.findall(r"\bBRA\s+0x([0-9a-f]+)", text) if int(target, 16) < at]
    return [text for at, text in instructions if any(lo <= at <= hi for lo, hi in loops)]


def local_in_loops(sass: str) -> int:
    """Local-memory loads and stores (spilled registers) inside a loop: one saved before a loop and
    restored after it costs once per program; inside, once per tile."""
    return sum(1 for text in in_loops(sass) if re.search(r"\b(STL|LDL)\b", text))


def cases() -> dict[str, tuple]:
    """name -> (kernel, cache dtype for the signature, constexprs, warps, whether the cache's rows
    are 16-byte aligned as CUDA keeps them)."""
    out = {}
    for model, (group, dim) in MODELS.items():
        rows = dot_pad(group)
        for cache in ("auto", "int8", "fp8_e4m3"):
            constants = dict(code_constants(kv_format(cache)), F32=False)
            aligned = cache == "auto" or kv_format(cache, "cuda").row_width(dim) % 16 == 0
            for products in (False, True) if cache != "auto" else (False,):  # quantized products: the codes multiplied
                out[f"decode-{cache}{'-products' if products else ''}-{model}"] = (
                    paged_attention._decode_partial, "bf16" if cache == "auto" else "u8",
                    dict(GROUP=group, ROWS=rows, DIM=dim, DIM_PAD=dim, BLOCK_SIZE=16,
                         TILE=decode_tile(dim, products), SOFTCAP=model in SOFT_CAPPED, PRODUCTS=products,
                         INTERPRETED=False, **constants), paged_attention.NUM_WARPS, aligned)
            tiles = {chunk: (*prefill_attention.prefill_tiles(dim, tokens, cache != "auto"), 0)
                     for chunk, tokens in (("long", 512), ("short", 16))}
            packed = prefill_attention.packed_tiles(dim, 5, group, cache != "auto")  # a step checking 4 drafts
            if packed is not None:
                tiles["drafts"] = packed
            for chunk, (block_m, block_n, group_pad) in tiles.items():
                if chunk == "short" and tiles["short"] == tiles["long"]:
                    continue  # the same compile
                out[f"prefill-{chunk}-{cache}-{model}"] = (
                    prefill_attention._prefill_kernel, "bf16" if cache == "auto" else "u8",
                    dict(GROUP=group, DIM=dim, DIM_PAD=dim, BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_N=block_n,
                         SOFTCAP=model in SOFT_CAPPED, GROUP_PAD=group_pad, **constants), prefill_attention.NUM_WARPS,
                    aligned)
    for dim in sorted({dim for _, dim in MODELS.values()}):  # the slices' reduction, at its default 4 warps
        out[f"decode-reduce-{dim}"] = (paged_attention._decode_reduce, "bf16",
                                       dict(DIM=dim, DIM_PAD=dim, CHUNK=paged_attention.REDUCE_CHUNK), 4)
    for rank in (16, 64):  # LoRA updates (paged_kernels/lora_update.py) at the default and a large --max-lora-rank
        out[f"lora-shrink-r{rank}"] = (lora_update._shrink, "bf16", dict(BLOCK_R=rank, BLOCK_K=lora_update.shrink_block_k(rank)),
                                       lora_update.NUM_WARPS)
        out[f"lora-expand-r{rank}"] = (lora_update._expand, "bf16", dict(BLOCK_R=rank, BLOCK_N=lora_update.BLOCK_N),
                                       lora_update.NUM_WARPS)
    return out



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="cases whose name holds this text")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile with TRITON_INTERPRET unset: an interpreted kernel cannot be compiled", file=sys.stderr)
        return 2
    usage = {name: resources(*case) for name, case in cases().items() if args.only in name}
    print(json.dumps({"bench": "sm90_compile", "triton": triton.__version__, "cases": usage}))
    print_table([{"case": name, **row} for name, row in usage.items()],
                [("case", lambda r: r["case"]), ("regs", lambda r: r["REG"]), ("stack", lambda r: r["STACK"]),
                 ("spills in loops", lambda r: r["local_in_loops"]), ("loop instructions", lambda r: r["loop_instructions"]),
                 ("async copies", lambda r: r["async_copies"]),
                 ("wgmma", lambda r: " ".join(r["wgmma"]) or "-")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
