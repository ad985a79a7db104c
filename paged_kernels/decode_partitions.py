"""How the decode kernel (``paged_kernels/paged_attention.py``) splits a context, as plain numbers that
memory planning and the CUDA graphs read without importing Triton: slices of ``PARTITION`` tokens,
each leaving float32 partials (an output row, a maximum and a sum per query head) for the reduction.
"""

from __future__ import annotations

PARTITION = 512  # context tokens per program of the decode kernel


def decode_splits(max_seq_len: int) -> int:
    """Slices a launch for contexts up to ``max_seq_len`` tokens is sized for."""
    return max(1, -(-max_seq_len // PARTITION))


def decode_scratch_bytes(num_seqs: int, num_heads: int, head_dim: int, max_seq_len: int) -> int:
    """Bytes of one decode launch's partials besides q and out (256 sequences x 32 heads of 128 at
    128k tokens: about 1 GiB), so that memory planning can count them."""
    return num_seqs * num_heads * decode_splits(max_seq_len) * (head_dim + 2) * 4


def decode_variant_lengths(max_model_len: int) -> list[int]:
    """One context length per compiled variant of the decode kernel's reduction (its slices padded
    to a power of two): 512, 1,024, 2,048 ... up to ``max_model_len``'s own."""
    lengths, splits = [], 1
    while splits < decode_splits(max_model_len):
        lengths.append(splits * PARTITION)
        splits *= 2
    return [*lengths, max_model_len]
