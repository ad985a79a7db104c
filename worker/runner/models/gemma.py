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

import torch
from torch import nn

from pagedserve.worker.runner.models.layers import CausalLM, DecoderLayer, OffsetRMSNorm


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
        x = self.model.embed_tokens(input_ids)
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype, device=x.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
