"""Rotary position embedding, computed the way transformers computes it (so greedy output matches).

The inverse frequencies come from the config: plain RoPE is computed here; scaled variants
(``llama3``, ``linear``, ``yarn`` …) use transformers' own ``ROPE_INIT_FUNCTIONS``, which also give
the attention factor applied to cos/sin. A ``partial_rotary_factor`` below 1 (Phi-4-mini) rotates
the first part of each head only; the rest passes unchanged.
"""

from __future__ import annotations

import torch
from torch import nn


def per_layer_type(config) -> bool:
    """Whether the config gives rope parameters per layer type (Gemma 3: ``{"full_attention": …,
    "sliding_attention": …}``)."""
    params = getattr(config, "rope_parameters", None)
    return bool(params) and all(isinstance(v, dict) for v in params.values())


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """``{"rope_type", "rope_theta", ...}`` from a transformers 5 (``rope_parameters``) or 4 config;
    ``layer_type``: that type's, where the config has them per type."""
    params = getattr(config, "rope_parameters", None)
    if params and layer_type is not None:
        return dict(params[layer_type])
    if params:
        return dict(params)
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    return {"rope_theta": getattr(config, "rope_theta", 10000.0), **scaling}


class RotaryEmbedding(nn.Module):
    def __init__(self, config, head_dim: int, layer_type: str | None = None) -> None:
        super().__init__()
        params = rope_parameters(config, layer_type)
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params["rope_theta"]
            dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            factor = 1.0
        elif rope_type == "dynamic":
            raise ValueError("dynamic NTK rope scaling is not supported (it changes with the sequence length)")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            extra = {"layer_type": layer_type} if layer_type is not None else {}
            inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, None, **extra)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.factor = float(factor)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[num_tokens, 1, rotary_dim]`` for the given absolute positions."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.factor, emb.sin() * self.factor
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]

    @staticmethod
    def apply(q: torch.Tensor, k: torch.Tensor, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos_sin
        dim = cos.shape[-1]
        if dim < q.shape[-1]:  # partial rotary: the first ``dim`` features of each head
            q_rot, k_rot = RotaryEmbedding.apply(q[..., :dim], k[..., :dim], cos_sin)
            return torch.cat((q_rot, q[..., dim:]), dim=-1), torch.cat((k_rot, k[..., dim:]), dim=-1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class Rotaries(nn.Module):
    """The model's rotary tables: one, or one per layer type (Gemma 3's local and global layers
    rotate with different bases); ``forward`` computes each once per step, keyed by layer type
    (``"default"`` where there is one table)."""

    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        types = sorted(config.rope_parameters) if per_layer_type(config) else []
        self.by_type = nn.ModuleDict({t: RotaryEmbedding(config, head_dim, t) for t in types} or
                                     {"default": RotaryEmbedding(config, head_dim)})
        self.layer_keys = [config.layer_types[i] if types else "default" for i in range(config.num_hidden_layers)]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {key: rotary(positions, dtype) for key, rotary in self.by_type.items()}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
