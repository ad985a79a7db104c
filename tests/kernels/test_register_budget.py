"""The attention and LoRA kernels compiled for Hopper (sm_90) on the CPU, at the head shapes of real models:
no register spills (a spill is local-memory traffic on every tile, invisible to a CPU test that
only checks results). Triton compiles for a ``GPUTarget`` without a device; the cubin's resource
usage is read with the ``cuobjdump`` Triton bundles. The compiling runs in one child process
(``python -m tests.kernels.test_register_budget``, which prints every case's usage as JSON):
the interpreter tests of this session decorate the kernels for ``TRITON_INTERPRET=1``, and an
interpreted kernel cannot be compiled. Skipped, with the reason, where Triton has no CUDA backend
or that tool."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import pytest

triton = pytest.importorskip("triton")

from pagedserve.kernels import lora_update, paged_attention, prefill_attention  # noqa: E402
from pagedserve.kernels.kv_format import kv_format  # noqa: E402
from pagedserve.kernels.paged_tiles import code_constants, dot_pad  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
MODELS = {  # (query heads per KV head, head_dim)
    "Llama-3-8B": (4, 128), "Llama-3-70B": (8, 128), "Qwen2.5-7B": (7, 128), "Gemma-2-9B": (2, 256),
    "Gemma-3-1B": (4, 256), "SmolLM2-135M": (3, 64), "Mistral-7B": (4, 128),
}
POINTERS = {"tables_ptr": "*i32", "lens_ptr": "*i32", "starts_ptr": "*i32", "slot_ptr": "*i32"}


def resources(fn, cache_dtype: str, constexprs: dict, num_warps: int) -> dict[str, int]:
    """``REG``, ``STACK``, ... of ``fn`` compiled for sm_90 with a cache of ``cache_dtype``."""
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
    compiled = triton.compile(ASTSource(fn, signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": num_warps})
    with tempfile.TemporaryDirectory() as folder:
        cubin = os.path.join(folder, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        usage = subprocess.run([CUOBJDUMP, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    line = next(text for text in usage.splitlines() if "REG:" in text)
    return {key: int(value) for key, value in re.findall(r"([A-Z]+):(\d+)", line)}


def cases() -> dict[str, tuple]:
    """name -> (kernel, cache dtype for the signature, constexprs, warps)."""
    out = {}
    for model, (group, dim) in MODELS.items():
        rows = dot_pad(group)
        block_m, block_n = prefill_attention.prefill_tiles(dim)
        for cache in ("auto", "int8"):
            constants = dict(code_constants(kv_format(cache)), F32=False)
            out[f"decode-{cache}-{model}"] = (
                paged_attention._decode_partial, "bf16" if cache == "auto" else "u8",
                dict(GROUP=group, ROWS=rows, DIM=dim, DIM_PAD=dim, BLOCK_SIZE=16, TILE=paged_attention.decode_tile(dim),
                     PARTITION=paged_attention.PARTITION, **constants), paged_attention.NUM_WARPS)
            out[f"prefill-{cache}-{model}"] = (
                prefill_attention._prefill_kernel, "bf16" if cache == "auto" else "u8",
                dict(GROUP=group, DIM=dim, DIM_PAD=dim, BLOCK_SIZE=16, BLOCK_M=block_m, BLOCK_N=block_n, **constants),
                prefill_attention.NUM_WARPS)
    for rank in (16, 64):  # LoRA updates (paged_kernels/lora_update.py) at the default and a large --max-lora-rank
        out[f"lora-shrink-r{rank}"] = (lora_update._shrink, "bf16", dict(BLOCK_R=rank, BLOCK_K=lora_update.shrink_block_k(rank)),
                                       lora_update.NUM_WARPS)
        out[f"lora-expand-r{rank}"] = (lora_update._expand, "bf16", dict(BLOCK_R=rank, BLOCK_N=lora_update.BLOCK_N),
                                       lora_update.NUM_WARPS)
    return out


@pytest.fixture(scope="module")
def usage():
    if not os.path.exists(CUOBJDUMP):
        pytest.skip(f"no cuobjdump in this Triton ({CUOBJDUMP})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.kernels.test_register_budget"], capture_output=True, text=True,
                          env=env, timeout=600)
    if done.returncode != 0:
        if "GPUTarget" in done.stderr or "cannot compile for CUDA" in done.stderr:
            pytest.skip(f"this Triton cannot compile for CUDA here: {done.stderr[-300:]}")
        raise AssertionError(f"compiling the kernels failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", sorted(cases()))
def test_the_kernels_keep_their_registers(usage, case):
    assert usage[case]["STACK"] == 0 and usage[case]["REG"] <= 255, usage[case]


def test_the_tiles_shrink_as_the_head_grows():
    assert paged_attention.decode_tile(64) == 64 and paged_attention.decode_tile(128) == 64
    assert paged_attention.decode_tile(256) == 32 and paged_attention.decode_tile(1024) == 16  # never below 16
    assert prefill_attention.prefill_tiles(128) == (64, 32) and prefill_attention.prefill_tiles(256) == (16, 32)


if __name__ == "__main__":
    print(json.dumps({name: resources(*case) for name, case in cases().items()}))
