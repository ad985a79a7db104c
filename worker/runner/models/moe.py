"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE).

A router (``gate``, no bias) scores every expert per token; softmax in float32, the top ``k``,
renormalised to sum to one where the family does (Mixtral always, Qwen ``norm_topk_prob``). The
experts run as the kernel ops' ``moe``: on the CPU a grouped loop over the experts that received
tokens (``paged_kernels/moe_reference.py``), on CUDA a fused Triton kernel over tokens sorted by expert
(``paged_kernels/fused_moe.py``). Expert weights are stacked as
transformers 5 keeps them: ``experts.gate_up_proj`` ``[E, 2I, H]`` and ``experts.down_proj``
``[E, H, I]``; checkpoints store them per expert and ``worker/runner/models/families.py`` stacks
them on load. Qwen2-MoE adds a shared expert, gated per token by a sigmoid.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.ops import AttentionOps
from pagedserve.worker.runner.models.layers import MLP, Reduce, summed


class Experts(nn.Module):
    """The stacked expert weights; the computation is the kernel ops' ``moe`` (the grouped torch
    loop on the CPU, the fused Triton kernel on CUDA)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, ops: AttentionOps) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.ops = ops

    def forward(self, x: torch.Tensor, top_index: torch.Tensor, top_weight: torch.Tensor) -> torch.Tensor:
        return self.ops.moe(x, self.gate_up_proj, self.down_proj, top_index, top_weight)


class SparseMoE(nn.Module):
    def __init__(self, config, ops: AttentionOps, num_experts: int, top_k: int, intermediate: int, renormalize: bool,
                 shared_intermediate: int = 0) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}: only 'silu'")
        self.top_k, self.renormalize = top_k, renormalize
        self.gate = nn.Linear(config.hidden_size, num_experts, bias=False)
        self.experts = Experts(num_experts, config.hidden_size, intermediate, ops)
        if shared_intermediate:
            self.shared_expert = MLP(config, shared_intermediate)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.has_shared = bool(shared_intermediate)
        self.reduce: Reduce | None = None  # tensor parallel: the experts' and the shared expert's partial sums, summed once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        top_weight, top_index = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            top_weight = top_weight / top_weight.sum(dim=-1, keepdim=True)
        out = self.experts(x, top_index, top_weight.to(x.dtype))
        if self.has_shared:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return summed(out, self.reduce)


def mixtral(config, index: int, ops: AttentionOps) -> nn.Module:
    return SparseMoE(config, ops, config.num_local_experts, config.num_experts_per_tok, config.intermediate_size, True)


def qwen_moe(config, index: int, ops: AttentionOps) -> nn.Module:
    """Qwen2-MoE / Qwen3-MoE (and OLMoE, whose experts are ``intermediate_size`` wide): sparse every
    ``decoder_sparse_step`` layers except ``mlp_only_layers``."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    if index in (getattr(config, "mlp_only_layers", None) or []) or config.num_experts == 0 or (index + 1) % step:
        return MLP(config)
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return SparseMoE(config, ops, config.num_experts, config.num_experts_per_tok, width,
                     bool(getattr(config, "norm_topk_prob", False)), getattr(config, "shared_expert_intermediate_size", 0))
