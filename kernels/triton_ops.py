"""The Triton kernels bundled as the attention backend used on CUDA."""

from kernels.copy_blocks import copy_blocks, swap_blocks
from kernels.paged_attention import paged_attention_decode
from kernels.prefill_attention import prefill_attention
from kernels.store_kv import store_kv
from worker.attention import AttentionOps


def make_ops() -> AttentionOps:
    return AttentionOps(store_kv, paged_attention_decode, prefill_attention, copy_blocks, swap_blocks)
