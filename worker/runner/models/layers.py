"""The decoder layers every supported family is built from, with paged attention: RMSNorm,
attention (grouped-query heads, optional q/k/v bias and per-head q/k norm), the gated SiLU MLP,
a decoder layer whose feed-forward block a family chooses (dense or mixture-of-experts,
``worker/runner/models/moe.py``), and the causal LM around them.

Module and parameter names follow Hugging Face's, so a safetensors checkpoint loads by name (a
family's ``weight_names`` maps the names that differ). The family differences are flags read from
the config (``Arch``): q/k/v bias (Qwen2, ``attention_bias``), per-head q/k RMSNorm (Qwen3),
grouped-query heads, rope scaling, tied embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from pagedserve.kernels.native_layer_ops import NativeLayerOps
from pagedserve.kernels.ops import AttentionOps
from pagedserve.worker.core.kv_cache.kv_layout import KvLayout
from pagedserve.worker.runner.attention.paged_attention import AttentionMetadata, PagedAttention
from pagedserve.worker.runner.models.rope import Rotaries, RotaryEmbedding
from pagedserve.worker.runner.models.vocab_parallel import VocabSlice

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Arch:
    """What differs between the supported architectures' attention."""

    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k (Qwen3)
    qk_norm_full: bool = False  # RMSNorm over the whole q and k projections, before the heads split (OLMoE)
    offset_norm: bool = False  # norms scale by 1 + weight (Gemma)


FeedForward = Callable[[object, int, AttentionOps], nn.Module]  # (config, layer index, ops) -> its MLP or MoE block
Reduce = Callable[[torch.Tensor], torch.Tensor]  # a rank's partial sum -> the sum over the ranks


def summed(x: torch.Tensor, reduce: Reduce | None) -> torch.Tensor:
    """``x`` summed over the tensor-parallel ranks (as it is without them)."""
    return x if reduce is None else reduce(x)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels: NativeLayerOps | None = None  # set by use_layer_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and (out := self.kernels.rms_norm(x, self.weight, self.eps)) is not None:
            return out
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def layer_window(config, index: int) -> int:
    """Layer ``index``'s sliding window (0: full attention): every layer's where the config has one
    (Mistral, Mixtral), or the layers ``layer_types`` calls ``sliding_attention`` (Qwen2 and later)."""
    window = int(getattr(config, "sliding_window", None) or 0)
    types = getattr(config, "layer_types", None)
    if types:
        return window if types[index] == "sliding_attention" else 0
    return window if getattr(config, "use_sliding_window", True) else 0


def kv_layout(config, hybrid: bool = True) -> KvLayout:
    """Which block table each layer reads and which row of the pool holds its KV: the layers grouped
    by their window (``worker/core/kv_cache/kv_layout.py``); not ``hybrid``: one table for all."""
    windows = [layer_window(config, i) for i in range(config.num_hidden_layers)]
    return KvLayout.of(windows) if hybrid else KvLayout.single(windows)


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by ``1 + weight``, in float32, then back to the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class Attention(nn.Module):
    def __init__(self, config, arch: Arch, ops: AttentionOps, window: int = 0) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        hidden = config.hidden_size
        bias = bool(getattr(config, "qkv_bias", arch.qkv_bias)) or bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bool(getattr(config, "attention_bias", False)))
        self.qkv_proj: nn.Linear | None = None  # q, k and v in one matrix, once fuse_projections has run
        self.qkv_sizes = (self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim)
        if arch.qk_norm or arch.qk_norm_full:
            width = 1 if arch.qk_norm else None  # per head, or the whole projection
            norm = OffsetRMSNorm if arch.offset_norm else RMSNorm
            self.q_norm = norm(self.head_dim * (width or self.num_heads), config.rms_norm_eps)
            self.k_norm = norm(self.head_dim * (width or self.num_kv_heads), config.rms_norm_eps)
        self.qk_norm, self.qk_norm_full = arch.qk_norm, arch.qk_norm_full
        self.clip = getattr(config, "clip_qkv", None)  # OLMoE: q, k, v clamped to [-clip, clip]
        scalar = getattr(config, "query_pre_attn_scalar", None)  # Gemma 2 scales by this, not by head_dim
        softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
        self.attn = PagedAttention(ops, (scalar or self.head_dim) ** -0.5, window, softcap)
        self.kernels: NativeLayerOps | None = None  # set by use_layer_kernels where q, k and v need nothing but the rotary
        self.reduce: Reduce | None = None  # tensor parallel: the sum of the ranks' partial outputs (worker/runner/parallel/)

    @property
    def plain(self) -> bool:
        """q, k and v go from the projection to the rotary and the cache with nothing between."""
        return not (self.qk_norm or self.qk_norm_full or self.clip is not None or self.qkv_proj is None)

    def forward(self, x, cos_sin, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        t = x.shape[0]
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        if self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:
            q, k, v = (y.clamp(-self.clip, self.clip) for y in (q, k, v))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.kernels is not None and self.kernels.rope_store(q, k, v, *cos_sin, *kv_cache, meta.slot_mapping):
            out = self.attn.attend(q, kv_cache, meta)  # q rotated, k and v stored by the kernel
        else:
            q, k = RotaryEmbedding.apply(q, k, cos_sin)
            out = self.attn(q, k, v, kv_cache, meta)
        return summed(self.o_proj(out.reshape(t, self.num_heads * self.head_dim)), self.reduce)

    @property
    def fused(self) -> bool:
        return self.qkv_proj is not None

    def fuse_projections(self) -> None:
        self.qkv_proj = concatenated(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj


class MLP(nn.Module):
    def __init__(self, config, intermediate_size: int | None = None) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        size = self.intermediate_size = intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(config.hidden_size, size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, size, bias=bias)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=bias)
        self.act = activation(config)
        self.gate_up_proj: nn.Linear | None = None  # gate and up in one matrix, once fuse_projections has run
        self.kernels: NativeLayerOps | None = None  # set by use_layer_kernels where the activation is SiLU
        self.reduce: Reduce | None = None  # tensor parallel, as Attention's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return summed(self.down_proj(self._hidden(x)), self.reduce)

    def _hidden(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.act(self.gate_proj(x)) * self.up_proj(x)
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None and (hidden := self.kernels.silu_mul(gate_up)) is not None:
            return hidden
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up

    @property
    def fused(self) -> bool:
        return self.gate_up_proj is not None

    def fuse_projections(self) -> None:
        self.gate_up_proj = concatenated(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj


def concatenated(*linears: nn.Linear) -> nn.Linear:
    """One ``nn.Linear`` computing the given ones' outputs side by side (their weights stacked); layers
    of another form stack themselves (``stacked_with``: a GGUF file's blocks kept as stored)."""
    if hasattr(linears[0], "stacked_with"):
        return linears[0].stacked_with(list(linears[1:]))
    bias = linears[0].bias is not None
    fused = nn.Linear(linears[0].in_features, sum(m.out_features for m in linears), bias=bias, device="meta")
    fused.weight = nn.Parameter(torch.cat([m.weight.detach() for m in linears]), requires_grad=False)
    if bias:
        fused.bias = nn.Parameter(torch.cat([m.bias.detach() for m in linears]), requires_grad=False)
    return fused


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def activation(config):
    name = getattr(config, "hidden_activation", None) or config.hidden_act  # Gemma names it hidden_activation
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r}: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def dense(config, index: int, ops: AttentionOps) -> nn.Module:
    return MLP(config)


class DecoderLayer(nn.Module):
    def __init__(self, config, arch: Arch, ops: AttentionOps, feed_forward: nn.Module, window: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(config, arch, ops, window)
        self.mlp = feed_forward
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos_sin, meta: AttentionMetadata, kv_cache: KVCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config, arch: Arch, ops: AttentionOps, feed_forward: FeedForward,
                 layer_class: type = DecoderLayer, norm_class: type = RMSNorm) -> None:
        super().__init__()
        # An uninitialised table (the checkpoint fills it): nn.Embedding's own init draws normal_,
        # which on the meta device runs torch's Python decompositions and imports torch._dynamo and
        # triton with them (+75 MiB resident on a CPU worker that never runs either).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(layer_class(config, arch, ops, feed_forward(config, i, ops), layer_window(config, i))
                                    for i in range(config.num_hidden_layers))
        self.norm = norm_class(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    layer_class: type = DecoderLayer  # a family with another layer shape (Gemma 2) subclasses these
    norm_class: type = RMSNorm

    def __init__(self, config, arch: Arch, ops: AttentionOps, feed_forward: FeedForward = dense) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config, arch, ops, feed_forward, self.layer_class, self.norm_class)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        first = self.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = first.num_kv_heads, first.head_dim
        self.rotary = Rotaries(config, self.head_dim)
        # which block table each layer reads and which row of the pool holds its KV
        self.kv_layout = kv_layout(config)
        self.vocab: VocabSlice | None = None  # tensor parallel: this rank's rows of the embedding and head
        # A decode step's layers as direct C calls (worker/runner/cpu/native_stack.py), where the loader
        # finds every layer the kernels': (x, tables, meta, kv_caches) -> hidden states, or None.
        self.native_stack: Callable | None = None

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            table = self.model.embed_tokens
            if hasattr(table, "as_linear"):  # a table in another form gives its own head (GgufEmbedding)
                self.lm_head = table.as_linear()
            else:
                self.lm_head.weight = table.weight

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list[KVCache]
    ) -> torch.Tensor:
        """Hidden states ``[num_tokens, hidden]`` for a flat batch of tokens."""
        x = self.embed(input_ids)
        tables = self.rotary(positions, x.dtype, meta.token_seq_lens if self.rotary.needs_seq_lens else None)
        stacked = self.native_stack(x, tables, meta, kv_caches) if self.native_stack is not None else None
        if stacked is not None:
            return self.model.norm(stacked)
        for layer, cache, key, lane in zip(self.model.layers, kv_caches, self.rotary.layer_keys, self.kv_layout.layer_lanes):
            x = layer(x, tables[key], meta.lane(lane), cache)
        return self.model.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding_rows(input_ids)

    def embedding_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding table's rows for ``input_ids`` (across the ranks' slices, under tensor parallel)."""
        if self.vocab is None:
            return self.model.embed_tokens(input_ids)
        return self.vocab.embed(self.model.embed_tokens, input_ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits, in the model's dtype, over the whole vocabulary."""
        logits = self.lm_head(hidden)
        return logits if self.vocab is None else self.vocab.gather(logits)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()
