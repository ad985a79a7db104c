"""The attention and LoRA kernels compiled for Hopper (sm_90) on the CPU, at the head shapes of real models:
no register spilled inside a loop (a spill there is local-memory traffic on every tile, invisible
to a CPU test that only checks results), and the long-chunk prefill kernel on full-width wgmma
products with its K/V loads pipelined. Triton compiles for a ``GPUTarget`` without a device; the cubin's resource
usage is read with the ``cuobjdump`` Triton bundles. The compiling runs in one child process
(``python -m pagedserve.bench.sm90_compile``, which prints every case's usage as a JSON line):
the interpreter tests of this session decorate the kernels for ``TRITON_INTERPRET=1``, and an
interpreted kernel cannot be compiled. Skipped, with the reason, where Triton has no CUDA backend
or that tool."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

from pagedserve.bench.sm90_compile import CUOBJDUMP, MODELS, cases  # noqa: E402
from pagedserve.kernels import paged_attention, prefill_attention  # noqa: E402


@pytest.fixture(scope="module")
def usage():
    if not os.path.exists(CUOBJDUMP):
        pytest.skip(f"no cuobjdump in this Triton ({CUOBJDUMP})")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "pagedserve.bench.sm90_compile"], capture_output=True, text=True,
                          env=env, timeout=600)
    if done.returncode != 0:
        if "GPUTarget" in done.stderr or "cannot compile for CUDA" in done.stderr:
            pytest.skip(f"this Triton cannot compile for CUDA here: {done.stderr[-300:]}")
        raise AssertionError(f"compiling the kernels failed:\n{done.stderr[-3000:]}")
    return next(json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"bench"'))["cases"]


@pytest.mark.parametrize("case", sorted(cases()))
def test_the_kernels_keep_their_registers(usage, case):
    """No spill inside a loop (the decode kernel at some GQA groups saves a register or two before
    its key loop and restores them after: up to 16 bytes of stack, once a program; the prefill of
    heads of 256 over an 8-bit cache, held to 128 registers, up to 40)."""
    got = usage[case]
    assert got["local_in_loops"] == 0 and got["STACK"] <= 48 and got["REG"] <= 255, got


@pytest.mark.parametrize("cache", ["int8", "fp8_e4m3"])
def test_an_8_bit_cache_is_read_in_aligned_loads_copied_ahead(usage, cache):
    """CUDA's 8-bit rows end in 16 bytes (``kv_format.ALIGNED_TAIL``), so a decode tile's codes come
    in 16-byte asynchronous copies, as a bf16 cache's do, not a byte at a time: the loop stays
    within 2.5x the bf16 kernel's instructions (rows of head_dim + 2 bytes: 1,949 int8, 2,758 fp8,
    against 332)."""
    for model in ("Llama-3-8B", "SmolLM2-135M", "Gemma-2-9B"):
        got, plain = usage[f"decode-{cache}-{model}"], usage[f"decode-auto-{model}"]
        assert got["async_copies"] > 0 and got["loop_instructions"] <= 2.5 * plain["loop_instructions"], (model, got)


def test_the_tiles_shrink_as_the_head_grows():
    assert paged_attention.decode_tile(64) == 64 and paged_attention.decode_tile(128) == 64
    assert paged_attention.decode_tile(256) == 32 and paged_attention.decode_tile(1024) == 16  # never below 16
    assert paged_attention.decode_tile(80) == paged_attention.decode_tile(128)  # a head padded to 128
    assert paged_attention.decode_tile(1024, quantized_products=True) == 32  # an 8-bit product's depth
    tiles = prefill_attention.prefill_tiles
    assert tiles(128, 65) == tiles(64, 4096) == (128, 64) and tiles(128, 64) == tiles(128, 4096, True) == (64, 32)
    assert tiles(256, 4096) == (64, 32) and tiles(256, 4096, True) == tiles(512, 4096) == (16, 32)


@pytest.mark.parametrize("model", [m for m, (_, dim) in MODELS.items() if dim <= 128])
def test_long_chunks_prefill_on_whole_warpgroup_products_with_pipelined_loads(usage, model):
    """The flash-attention shape on Hopper: each warpgroup's products take 64 whole rows and a whole
    key tile (m64n64 scores, m64nDIM weighted values), K and V brought into shared memory by
    asynchronous copies a few tiles ahead (software pipelining)."""
    dim = MODELS[model][1]
    got = usage[f"prefill-long-auto-{model}"]
    assert got["wgmma"] == sorted({"m64n64k16", f"m64n{dim}k16"}) and got["async_copies"] > 0, got


@pytest.mark.parametrize("cache", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("model", ["Llama-3-8B", "Gemma-2-9B", "SmolLM2-135M"])
def test_quantized_products_feed_the_codes_to_8_bit_tensor_cores_with_keys_as_rows(usage, cache, model):
    """``--quantized-products``: both of a tile's products are Hopper's 8-bit wgmma (k32; bf16's are
    k16), 64 keys or head channels as their rows and the group's queries as their columns (n8 or n16,
    where queries as rows would pad a group of 4 to 64: 1,579 loop instructions and 225 registers at
    Llama-3-8B's heads over fp8, against 754 and 113), the codes copied into shared memory
    asynchronously."""
    got = usage[f"decode-{cache}-products-{model}"]
    assert got["wgmma"] and got["async_copies"] > 0, got
    assert all(shape.startswith("m64n") and shape.endswith("k32") and int(shape[4:-3]) <= 16 for shape in got["wgmma"]), got
