"""Gemma 2 and Gemma 3 (text) on the shared layers: their RMSNorm scales by ``1 + weight``, each layer norms around
both its attention and its MLP ("sandwich" norms), embeddings are scaled by ``sqrt(hidden)``,
attention scores and final logits are soft-capped (``cap * tanh(x / cap)``), the MLP uses tanh
GELU, attention alternates sliding-window and global layers (``layer_types``) and scales queries
by ``query_pre_attn_scalar``. Gemma 3 drops the soft caps, norms q and k per head and rotates
its local and global layers with different bases (``Rotaries``). The attention-side pieces are
read from the config by the shared ``Attention``; this file holds what differs in the layer and
the model around it.
"""

from __future__ import annotations

import struct

import torch
from torch import nn

from pagedserve.worker.runner.models.layers import CausalLM, DecoderLayer, OffsetRMSNorm


def rounded_to(value: float, dtype: torch.dtype) -> float:
    """``value`` as ``dtype`` would hold it (round to nearest even), computed on the host without a
    tensor: float32 and float16 through ``struct``, bfloat16 as float32's upper half."""
    if dtype == torch.float16:
        return struct.unpack("<e", struct.pack("<e", value))[0]
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if dtype == torch.bfloat16:
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return struct.unpack("<f", struct.pack("<I", bits))[0]


class Gemma2DecoderLayer(DecoderLayer):
    def __init__(self, config, arch, ops, feed_forward: nn.Module, window: int = 0) -> None:
        super().__init__(config, arch, ops, feed_forward, window)
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(size, eps)
        self.post_attention_layernorm = OffsetRMSNorm(size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(size, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(size, eps)

    def forward(self, x, cos_sin, meta, kv_cache) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos_sin, meta, kv_cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2ForCausalLM(CausalLM):
    layer_class = Gemma2DecoderLayer
    norm_class = OffsetRMSNorm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings times ``sqrt(hidden)`` rounded to the model's dtype, as transformers scales
        them; a Python number, so nothing crosses from the host inside a CUDA graph."""
        x = self.embedding_rows(input_ids)
        return x * rounded_to(self.config.hidden_size**0.5, x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
