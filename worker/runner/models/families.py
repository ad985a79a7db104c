"""The supported model families: ``config.model_type`` -> how to build the model and how its
checkpoint names map onto the model's parameters.

Dense families share ``CausalLM`` with flags (``Arch``); mixture-of-experts families choose a
sparse feed-forward block per layer (``worker/runner/models/moe.py``) and stack their per-expert
checkpoint tensors on load; Phi-3 splits its fused q/k/v and gate/up tensors on load. Anything else is an ``UnsupportedModelError`` naming the families.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from pagedserve.worker.runner.models.gemma import Gemma2ForCausalLM
from pagedserve.worker.runner.models.layers import Arch, CausalLM, FeedForward, dense
from pagedserve.worker.runner.models.moe import mixtral, qwen_moe

ExpertPart = tuple[str, int, str]  # (stacked parameter prefix, expert index, "gate" | "up" | "down")


@dataclass(frozen=True)
class Fused:
    """A checkpoint tensor holding several parameters one after another along dim 0 (Phi-3's
    ``qkv_proj``, ``gate_up_proj``); each part's size is its parameter's."""

    targets: tuple[str, ...]


Rename = Callable[[str], "str | ExpertPart | Fused"]


def same(name: str) -> str:
    return name


def _experts(pattern: str, parts: dict[str, str], before: Rename = same) -> Rename:
    expert = re.compile(pattern)

    def rename(name: str):
        name = before(name)
        found = expert.fullmatch(name)
        return (found[1] + ".experts", int(found[2]), parts[found[3]]) if found else name

    return rename


mixtral_names = _experts(r"(.*\.mlp)\.experts\.(\d+)\.(w1|w2|w3)\.weight", {"w1": "gate", "w3": "up", "w2": "down"},
                         lambda name: name.replace(".block_sparse_moe.", ".mlp."))
qwen_moe_names = _experts(r"(.*\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight",
                          {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})


_PHI3_FUSED = re.compile(r"(.*)\.(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight")


def phi3_names(name: str):
    found = _PHI3_FUSED.fullmatch(name)
    if found is None:
        return name
    parts = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj") if found[2].startswith("self_attn") \
        else ("mlp.gate_proj", "mlp.up_proj")
    return Fused(tuple(f"{found[1]}.{part}.weight" for part in parts))


@dataclass(frozen=True)
class Family:
    arch: Arch
    feed_forward: FeedForward = dense
    rename: Rename = same
    model: type = CausalLM  # the model class (a subclass where the layer or its surroundings differ)


FAMILIES = {  # the same model types as CAUSAL_LM (worker/source/model_types.py), which names their classes
    "llama": Family(Arch()),
    "mistral": Family(Arch()),
    "qwen2": Family(Arch(qkv_bias=True)),
    "qwen3": Family(Arch(qk_norm=True)),
    "mixtral": Family(Arch(), mixtral, mixtral_names),
    "qwen2_moe": Family(Arch(qkv_bias=True), qwen_moe, qwen_moe_names),
    "qwen3_moe": Family(Arch(qk_norm=True), qwen_moe, qwen_moe_names),
    "olmoe": Family(Arch(qk_norm_full=True), qwen_moe, qwen_moe_names),
    "phi3": Family(Arch(), dense, phi3_names),
    "gemma2": Family(Arch(offset_norm=True), dense, same, Gemma2ForCausalLM),
    "gemma3_text": Family(Arch(qk_norm=True, offset_norm=True), dense, same, Gemma2ForCausalLM),
}
