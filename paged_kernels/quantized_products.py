"""Triton: decode attention's products taken on an 8-bit cache's codes as they are stored
(``--quantized-products``; the numbers are ``quantized_products_reference.py``'s).

The plain path (``paged_tiles.load_kv_tile``) turns every code into a float before its products; on
a GPU that conversion is most of an 8-bit key tile's instructions (docs/benchmarks.md). Here the
codes go to the tensor cores unconverted (Hopper's wgmma takes int8 and e4m3 operands), and what
meets them is quantized to the cache's codes too (``CODE``: int8, or fp8_e4m3 by the hardware's
conversion):

- the queries, once per program: each query head over its largest magnitude, times the format's
  largest code (127 or 448);
- the probabilities, once per key tile: each query's ``p * v_scale`` over the tile's largest, times
  the same.

The products' sums (int32 exact, or float32) are scaled back: the scores by the query's and each
key row's scale, the weighted values by the tile's ``largest / code``. Lossy beyond the cache
(measured on real weights in docs/engine.md). The 8-bit products take 64 rows at least, so the keys
(scores) and the head's channels (weighted values) are their rows and the group's queries their
columns: a group of 4 padded to 64 rows would double the kernel's instructions.
"""

import triton
import triton.language as tl

from pagedserve.kernels import quantized_products_reference
from pagedserve.kernels.paged_tiles import row_scales

FLOOR = tl.constexpr(quantized_products_reference.FLOOR)  # the reference's floor on a scale-back factor


@triton.jit
def largest_code(CODE: tl.constexpr):
    """The largest magnitude a code of ``CODE`` holds: int8's 127, e4m3's 448."""
    largest = 448.0
    if CODE == 1:
        largest = 127.0
    return largest


@triton.jit
def to_codes(x, CODE: tl.constexpr, INTERPRETED: tl.constexpr):
    """float32 ``x`` (within +-``largest_code`` up to rounding) as codes, rounded to the nearest (ties
    to even) and saturated. int8: rounded by adding and taking away 1.5 * 2**23 (an FMA with the
    scaling before it rounds once). e4m3: the hardware's conversion; the interpreter's drops a carry
    into the exponent (0.498 became 0.25), so there the value is first put on e4m3's grid in float32,
    which it converts exactly."""
    if CODE == 1:
        codes = tl.minimum(tl.maximum((x + 12582912.0) - 12582912.0, -127.0), 127.0).to(tl.int8)
    else:
        if INTERPRETED:
            bits = x.to(tl.int32, bitcast=True)
            normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)  # 3 mantissa bits
            small = ((x * 512.0 + 12582912.0) - 12582912.0) * 0.001953125  # below 2**-6: steps of 2**-9
            x = tl.minimum(tl.maximum(tl.where(tl.abs(x) < 0.015625, small, normal), -448.0), 448.0)
        codes = x.to(tl.float8e4nv)
    return codes


@triton.jit
def column_codes(x, CODE: tl.constexpr, INTERPRETED: tl.constexpr):
    """``x`` ``[rows, cols]`` float32 as ``(codes, back)``: each column over its largest magnitude
    times ``largest_code``, as codes, and the float32 factor ``largest / largest_code`` that scales a
    product of them back (0 for a column of zeros, whose codes are zeros)."""
    back = tl.max(tl.abs(x), axis=0) / largest_code(CODE)
    return to_codes(x * (1.0 / tl.maximum(back, FLOOR))[None, :], CODE, INTERPRETED), back


@triton.jit
def load_code_tile(ptr, offs, d, valid, DIM: tl.constexpr, CODE: tl.constexpr):
    """``(codes, scale)``: a tile's codes ``[len(offs), DIM_PAD]`` as stored, int8 or e4m3 (zeros
    where ``valid`` is false or past ``DIM``), and each row's scale."""
    mask = valid[:, None] & (d[None, :] < DIM)
    raw = tl.load(ptr + offs[:, None] + d[None, :], mask=mask, other=0)
    if CODE == 1:
        codes = raw.to(tl.int8, bitcast=True)
    else:
        codes = raw.to(tl.float8e4nv, bitcast=True)
    return codes, row_scales(ptr, offs, valid, DIM)


@triton.jit
def code_scores(q_codes_t, q_back, k_codes, k_scale, scale):
    """``[rows, keys]`` scores: the codes' product (keys as the product's rows: ``q_codes_t`` is
    ``[DIM_PAD, rows]``; int8's sums are exact int32), scaled by each key's and query's factor and
    the softmax scale."""
    return tl.trans(tl.dot(k_codes, q_codes_t).to(tl.float32) * (k_scale * scale)[:, None] * q_back[None, :])


@triton.jit
def code_weighted(p, v_codes, v_scale, CODE: tl.constexpr, INTERPRETED: tl.constexpr):
    """``[rows, DIM_PAD]``: probabilities ``p`` ``[rows, keys]`` times a tile's values, each value
    row's scale folded into ``p`` and every query's weights quantized over the tile (``column_codes``)
    before the product (the head's channels as the product's rows)."""
    weights, back = column_codes(tl.trans(p) * v_scale[:, None], CODE, INTERPRETED)
    return tl.trans(tl.dot(tl.trans(v_codes), weights).to(tl.float32) * back[None, :])
