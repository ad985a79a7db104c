"""How the decode kernel (``paged_kernels/paged_attention.py``) walks a context, as plain numbers that
memory planning, the CUDA graphs and the torch reference read without importing Triton: key tiles
of ``decode_tile`` positions, slices of ``decode_partition`` tokens, each leaving float32 partials (an
output row, a maximum and a sum per query head) for the reduction.

Many sequences fill the device with slices of 512 tokens; a few long ones would not (one sequence
at 32k tokens with 8 KV heads is 512 programs for 132 SMs, each walking 512 tokens one tile after
another: 16% of the copy bandwidth on an H200), so their slices are cut finer until the launch has
``FILL_PROGRAMS`` programs, down to 128 tokens (two key tiles) and up to ``MAX_SPLITS`` slices.
"""

from __future__ import annotations

TILE_ELEMENTS = 8192  # a key tile's keys x head elements (TILE x DIM_PAD) per K or V load
PRODUCT_DEPTH = 32  # an 8-bit product's: with quantized products the probabilities' product sums over 32 keys at least
PARTITIONS = (512, 256, 128)  # context tokens per program of the decode kernel, coarsest first
FILL_PROGRAMS = 1024  # about 8 programs per SM of an H100 or H200 (132 SMs)
MAX_SPLITS = 256  # slices of one sequence at most (128k tokens in slices of 512)


def decode_tile(head_dim: int, quantized_products: bool = False) -> int:
    """Key positions per tile of the decode kernel: 64, 32 for heads of 256 (at 8 warps no spills at
    sm_90, plain or int8 caches: tests/kernels/test_register_budget.py; 4 warps spilled at heads of
    128); with quantized products (``paged_kernels/quantized_products.py``) never below their depth
    of 32 keys."""
    dim_pad = max(1 << (head_dim - 1).bit_length(), 16)  # the kernels' head padded for their products
    tile = 64
    while tile > 16 and tile * dim_pad > TILE_ELEMENTS:
        tile //= 2
    return max(tile, PRODUCT_DEPTH) if quantized_products else tile


def decode_partition(num_seqs: int, kv_heads: int, max_seq_len: int) -> int:
    """Context tokens per program of a launch for ``num_seqs`` sequences of up to ``max_seq_len``
    tokens: 512, or finer while the launch's programs (sequences x KV heads x slices) stay under
    ``FILL_PROGRAMS`` and the slices within ``MAX_SPLITS``."""
    for partition, finer in zip(PARTITIONS, PARTITIONS[1:]):
        programs = num_seqs * kv_heads * decode_splits(max_seq_len, partition)
        if programs >= FILL_PROGRAMS or decode_splits(max_seq_len, finer) > MAX_SPLITS:
            return partition
    return PARTITIONS[-1]


def decode_splits(max_seq_len: int, partition: int = PARTITIONS[0]) -> int:
    """Slices of ``partition`` tokens a launch for contexts up to ``max_seq_len`` tokens is sized for."""
    return max(1, -(-max_seq_len // partition))


def decode_scratch_bytes(num_seqs: int, num_heads: int, head_dim: int, max_seq_len: int) -> int:
    """Bytes of the partials of the largest decode launch of up to ``num_seqs`` sequences besides q
    and out (256 sequences x 32 heads of 128 at 128k tokens: about 1 GiB), so that memory planning
    can count them: a smaller batch cut finer may hold more slices than the largest (counted with
    one KV head, the finest cut)."""
    rows = max((n * decode_splits(max_seq_len, decode_partition(n, 1, max_seq_len)) for n in range(1, num_seqs + 1)), default=0)
    return rows * num_heads * (head_dim + 2) * 4
