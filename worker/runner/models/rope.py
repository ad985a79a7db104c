"""Rotary position embedding, computed the way transformers computes it (so greedy output matches).

The inverse frequencies come from the config: plain RoPE is computed here; scaled variants
(``llama3``, ``linear``, ``yarn`` …) use transformers' own ``ROPE_INIT_FUNCTIONS``, which also give
the attention factor applied to cos/sin. A ``partial_rotary_factor`` below 1 (Phi-4-mini) rotates
the first part of each head only; the rest passes unchanged.

Two variants change with the sequence's length, which transformers reads as the last position of
the forward pass: ``dynamic`` (NTK) raises the base once the sequence passes
``max_position_embeddings``, and ``longrope`` (Phi-3) switches from the short to the long factors
past ``original_max_position_embeddings``. Here each token takes its own sequence's length (the
tokens known, computed or not: a prompt's every chunk takes the whole prompt's, as transformers'
one forward over it does), ``AttentionMetadata.token_seq_lens``, so one batch mixes short and long
sequences and each rotates as a transformers ``generate`` of it alone. transformers recomputes a
Phi-3 sequence's whole cache when it grows past the switch; so does the scheduler
(``SchedulerConfig.rope_switch``, from ``rope_switch`` here), and the prefix cache keeps short-
and long-rotated blocks apart. Dynamic NTK keeps the KV computed with earlier bases, as
transformers does, so a sequence recomputed after a preemption (or one that hits a prefix cached
by a shorter one) rotates its old positions with its current base: near transformers, not equal.
"""

from __future__ import annotations

import torch
from torch import nn


def per_layer_type(config) -> bool:
    """Whether the config gives rope parameters per layer type (Gemma 3: ``{"full_attention": …,
    "sliding_attention": …}``)."""
    params = getattr(config, "rope_parameters", None)
    return bool(params) and all(isinstance(v, dict) for v in params.values())


def rope_switch(config) -> int:
    """The length past which a long-rope model rotates with its long factors (0: no such length)."""
    params = rope_parameters(config)
    return _original_length(params, config) if params.get("rope_type") == "longrope" else 0


def _original_length(params: dict, config) -> int:
    """``original_max_position_embeddings``: from the rope parameters, else the config (0: none)."""
    return int(params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None) or 0)


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
        self.rope_type = rope_type = params.get("rope_type", "default")
        self.dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))
        self.base = float(params["rope_theta"])
        self.scale_factor = float(params.get("factor") or 1.0)
        self.max_position = int(config.max_position_embeddings)
        self.switch_after = _original_length(params, config)
        # The tables are computed on the CPU whatever the default device (the loader builds the model
        # on meta, where this arithmetic would run torch's decompositions and import torch._dynamo
        # and triton with them) and moved with the model.
        with torch.device("cpu"):
            if rope_type in ("default", "dynamic"):  # dynamic: at most max_position_embeddings, the plain base
                inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float) / self.dim))
                factor = 1.0
            else:
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                extra = {"layer_type": layer_type} if layer_type is not None else {}
                inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **extra)
                if rope_type == "longrope":  # the long factors, for sequences past the original length
                    long_inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=self.switch_after + 1, **extra)
                    self.register_buffer("long_inv_freq", long_inv_freq.float(), persistent=False)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.factor = float(factor)

    @property
    def needs_seq_lens(self) -> bool:
        return self.rope_type in ("dynamic", "longrope")

    def token_inv_freq(self, seq_lens: torch.Tensor | None) -> torch.Tensor:
        """The inverse frequencies ``[1 or num_tokens, rotary_dim / 2]``: one row for all tokens, or
        (dynamic, longrope) one per token from its sequence's context length."""
        if self.rope_type == "longrope":
            return torch.where((seq_lens > self.switch_after)[:, None], self.long_inv_freq[None, :], self.inv_freq[None, :])
        if self.rope_type == "dynamic":  # as transformers' _compute_dynamic_ntk_parameters, per token
            seq_len = torch.clamp(seq_lens.to(torch.int64), min=self.max_position)
            f = self.scale_factor
            base = self.base * ((f * seq_len / self.max_position) - (f - 1)) ** (self.dim / (self.dim - 2))
            exponents = torch.arange(0, self.dim, 2, dtype=torch.int64, device=seq_lens.device).float() / self.dim
            return 1.0 / (base[:, None] ** exponents[None, :])
        return self.inv_freq[None, :]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[num_tokens, 1, rotary_dim]`` for the given absolute positions;
        ``seq_lens``: each token's sequence length through this step (dynamic and longrope)."""
        freqs = positions[:, None].float() * self.token_inv_freq(seq_lens)
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
        self.needs_seq_lens = any(rotary.needs_seq_lens for rotary in self.by_type.values())

    def forward(self, positions: torch.Tensor, dtype: torch.dtype,
                seq_lens: torch.Tensor | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {key: rotary(positions, dtype, seq_lens) for key, rotary in self.by_type.items()}


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
