"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), on the CPU as a grouped
loop over the experts that received tokens.

A router (``gate``, no bias) scores every expert per token; softmax in float32, the top ``k``,
renormalised to sum to one where the family does (Mixtral always, Qwen ``norm_topk_prob``). Each
hit expert runs once on all of its tokens (one gather, two matmuls, one ``index_add_``), so the
work is proportional to the tokens routed, not to tokens x experts. Expert weights are stacked as
transformers 5 keeps them: ``experts.gate_up_proj`` ``[E, 2I, H]`` and ``experts.down_proj``
``[E, H, I]``; checkpoints store them per expert and ``worker/runner/models/families.py`` stacks
them on load. Qwen2-MoE adds a shared expert, gated per token by a sigmoid.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from worker.runner.models.layers import MLP


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, top_index: torch.Tensor, top_weight: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        flat_expert = top_index.reshape(-1)
        order = flat_expert.argsort(stable=True)  # the (token, slot) pairs grouped by expert
        counts = torch.bincount(flat_expert, minlength=self.gate_up_proj.shape[0]).tolist()
        tokens = order // top_index.shape[1]
        weights = top_weight.reshape(-1)[order]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            gate, up = F.linear(x[rows], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, rows, y * weights[start : start + count, None].to(y.dtype))
            start += count
        return out


class SparseMoE(nn.Module):
    def __init__(self, config, num_experts: int, top_k: int, intermediate: int, renormalize: bool,
                 shared_intermediate: int = 0) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}: only 'silu'")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, config.hidden_size, intermediate)
        if shared_intermediate:
            self.shared_expert = MLP(config, shared_intermediate)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.has_shared = bool(shared_intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        top_weight, top_index = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            top_weight = top_weight / top_weight.sum(dim=-1, keepdim=True)
        out = self.experts(x, top_index, top_weight.to(x.dtype))
        if self.has_shared:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def mixtral(config, index: int) -> nn.Module:
    return SparseMoE(config, config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True)


def qwen_moe(config, index: int) -> nn.Module:
    """Qwen2-MoE / Qwen3-MoE (and OLMoE, whose experts are ``intermediate_size`` wide): sparse every
    ``decoder_sparse_step`` layers except ``mlp_only_layers``."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    if index in (getattr(config, "mlp_only_layers", None) or []) or config.num_experts == 0 or (index + 1) % step:
        return MLP(config)
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return SparseMoE(config, config.num_experts, config.num_experts_per_tok, width,
                     bool(getattr(config, "norm_topk_prob", False)), getattr(config, "shared_expert_intermediate_size", 0))
