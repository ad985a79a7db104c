"""A decode step's whole decoder stack as direct calls of the C kernels, where every layer's small
operations are theirs: the RMSNorms, the rotary with the K/V store, the paged decode attention and
SiLU; the matrices int8, float32 or bfloat16 on the C kernels (``csrc/int8_linear.c``,
``csrc/float_linear.c``), a GGUF's blocks as stored (``csrc/gguf_linear.c``) or, in any other form
(int4, oneDNN's prepacked layers where the kernels are not the model's), the layer's own module,
called directly.

Through the modules, a layer of a one-token step costs ~90 us of Python (module calls, argument
checks, views, an allocation per result) around ~80 us of kernels (SmolLM2, int8, 2 CPU cores,
docs/benchmarks.md). Here the checks run once per step, the results go to buffers allocated once per
step, and each layer is a few C calls, the matrices and two in-place adds: the same kernels on the
same inputs in the same order, so the same bits as the module path (tested). A step whose rows are
a few tokens each (a speculative draft being checked) runs here too, each token as a decode of its
own: the bits one decode step a token gives. Anything else (a longer prefill chunk in the step, a
quantized cache, another rotary, a layer with a norm the kernels do not run) takes the module path:
``NativeStack.of`` answers None for a model it cannot run, and a call answers None for a step it
does not take. Built after the last change to the model's modules (the loader's last step): it
holds them.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Callable

import torch
from torch import nn

from pagedserve.kernels.checks import check_tables
from pagedserve.kernels.native_attention import chunk_tokens
from pagedserve.kernels.native_layer_ops import NativeLayerOps
from pagedserve.worker.core.speculative.config import MAX_SPECULATIVE_TOKENS
from pagedserve.worker.runner.attention.paged_attention import AttentionMetadata
from pagedserve.worker.runner.cpu.gguf_linear import GgufLinear
from pagedserve.worker.runner.cpu.prepack import PanelLinear
from pagedserve.worker.runner.cpu.quantized_linear import Int8Linear
from pagedserve.worker.runner.lora.lora_linear import LoraStep, add_updates, layer_keys
from pagedserve.worker.runner.models.layers import MLP, Attention, CausalLM, DecoderLayer, RMSNorm


@dataclass(frozen=True)
class _Int8Matrix:
    """An int8 layer on the C kernel: its codes (panel layout), scales and bias as data pointers."""

    run: object  # the kernel (NativeLayerOps.raw("int8_linear", dtype))
    panels: int
    scale: int
    bias: int  # 0: none
    width: int  # inputs
    outs: int
    npanels: int

    def __call__(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.run(source.data_ptr(), self.panels, self.scale, self.bias or None, target.data_ptr(), source.shape[0],
                    self.width, self.outs, self.npanels, torch.get_num_threads()):
            raise MemoryError("the int8 kernel could not allocate its scratch rows")
        return target


@dataclass(frozen=True)
class _FloatMatrix:
    """A float32 or bfloat16 layer on the C kernel (``PanelLinear``): its panels and bias as data pointers."""

    run: object  # NativeLayerOps.raw("float_linear", dtype)
    panels: int
    bias: int  # 0: none
    width: int
    outs: int
    npanels: int

    def __call__(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.run(source.data_ptr(), self.panels, self.bias or None, target.data_ptr(), source.shape[0], self.width,
                    self.outs, self.npanels, torch.get_num_threads()):
            raise MemoryError("the float kernel could not allocate its scratch rows")
        return target


@dataclass(frozen=True)
class _GgufMatrix:
    """A GGUF file's blocks run as stored (``GgufLinear``): a kernel call per part, each writing its
    columns of the output (the row kernel: a step of the layer's GEMM size or more is left to the
    modules, ``NativeStack.gemm_rows``)."""

    parts: tuple[tuple[object, int, int, int, int], ...]  # (its kernel: NativeLayerOps.raw, blocks pointer, ggml type, first column, columns)
    bias: int  # 0: none
    width: int
    outs: int
    item: int  # bytes per output value

    def __call__(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for run, blocks, kind, first, count in self.parts:
            bias = self.bias + first * self.item if self.bias else None
            if run(source.data_ptr(), blocks, kind, bias, target.data_ptr() + first * self.item, source.shape[0],
                        self.width, count, self.outs, torch.get_num_threads()):
                raise MemoryError("the GGUF kernel could not allocate its scratch rows")
        return target


@dataclass(frozen=True)
class _ModuleMatrix:
    """Any other linear layer: its own forward (what the module path calls), a new result."""

    module: nn.Module

    def __call__(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.module.forward(source)


SHORT_ROW = 1 + MAX_SPECULATIVE_TOKENS  # the longest row the stack takes: a token and the longest draft
Matrix = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (input rows, a buffer it may fill) -> output rows


@dataclass(frozen=True)
class _AdaptedMatrix:
    """A matrix, then the low-rank updates of this step's LoRA adapters (``worker/runner/lora/``), as the
    module path's ``LoraLinear`` adds them."""

    base: Matrix
    key: str
    step: LoraStep

    def __call__(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return add_updates(self.base(source, target), source, self.key, self.step)


@dataclass(frozen=True)
class _Layer:
    norm_in: int
    norm_post: int
    qkv: Matrix
    o: Matrix
    gate_up: Matrix
    down: Matrix
    eps_in: float
    eps_post: float
    scale: float
    window: int
    softcap: float


def token_contexts(meta: AttentionMetadata, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of the step's ``t`` tokens as a decode of its own: its row's block table and the positions
    it sees (its own and the ones before it; the step's K/V are stored before any is read), so a short
    row's tokens get, bit for bit, what one decode step each would give them."""
    if meta.num_decodes == t:
        return meta.decode_block_tables.contiguous(), meta.decode_seq_lens.contiguous()
    tokens = chunk_tokens(meta.prefill_query_start, meta.prefill_seq_lens, t - meta.num_decodes)
    width = max(meta.decode_block_tables.shape[1], meta.prefill_block_tables.shape[1])
    pad = lambda tables: torch.nn.functional.pad(tables, (0, width - tables.shape[1]))  # noqa: E731
    tables = torch.cat([pad(meta.decode_block_tables), pad(meta.prefill_block_tables)[tokens.chunk]])
    return tables.contiguous(), torch.cat([meta.decode_seq_lens, tokens.seen.to(torch.int32)]).contiguous()


def _matrix(linear: nn.Module, kernels: NativeLayerOps, dtype: torch.dtype) -> Matrix:
    if type(linear) is Int8Linear and linear.kernels is not None:
        bias = linear.bias.data_ptr() if linear.bias is not None else 0
        return _Int8Matrix(kernels.raw("int8_linear", dtype), linear.codes.data_ptr(), linear.scale.data_ptr(), bias,
                           linear.in_features, linear.out_features, linear.codes.shape[0])
    if type(linear) is PanelLinear and linear.weight.dtype == dtype:
        bias = linear.bias.data_ptr() if linear.bias is not None else 0
        return _FloatMatrix(kernels.raw("float_linear", dtype), linear.weight.data_ptr(), bias, linear.in_features,
                            linear.out_features, linear.weight.shape[0])
    if type(linear) is GgufLinear and (linear.bias is None or linear.bias.dtype == dtype):
        parts, first = [], 0
        for part in linear.parts:
            int8 = linear.int8_inputs and kernels.gguf_x8_runs(part.gguf_type)
            run = kernels.raw("gguf_linear_x8" if int8 else "gguf_linear", dtype)
            parts.append((run, part.blocks.data_ptr(), part.gguf_type, first, part.rows))
            first += part.rows
        bias = linear.bias.data_ptr() if linear.bias is not None else 0
        return _GgufMatrix(tuple(parts), bias, linear.in_features, linear.out_features,
                           dtype.itemsize)
    return _ModuleMatrix(linear)


def _gives_packed_rows(linear: nn.Module, dtype: torch.dtype) -> bool:
    """Whether a linear layer answers rows at ``dtype``, packed (what the kernels after it read): tried."""
    with torch.inference_mode():
        out = linear(torch.zeros((2, linear.in_features), dtype=dtype, device="cpu"))
    return out.dtype == dtype and out.shape == (2, linear.out_features) and out.is_contiguous()


def _runs_entirely(layer) -> bool:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return (type(layer) is DecoderLayer and type(attention) is Attention and attention.kernels is not None
            and attention.plain and type(mlp) is MLP and mlp.kernels is not None and mlp.gate_up_proj is not None
            and all(type(n) is RMSNorm and n.kernels is not None
                    for n in (layer.input_layernorm, layer.post_attention_layernorm)))


def _matrices(layer) -> tuple:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


class NativeStack:
    """The decoder layers of one model as C calls (see the module's text)."""

    def __init__(self, model: CausalLM, kernels: NativeLayerOps, dtype: torch.dtype) -> None:
        self.dtype = dtype
        first = model.model.layers[0].self_attn
        self.heads, self.kv_heads, self.dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.hidden = model.config.hidden_size
        self.inter = model.model.layers[0].mlp.gate_up_proj.out_features // 2
        self.layers = [_Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                              *(_matrix(m, kernels, dtype) for m in _matrices(layer)),
                              layer.input_layernorm.eps, layer.post_attention_layernorm.eps, layer.self_attn.attn.scale,
                              layer.self_attn.attn.extra.get("window", 0), layer.self_attn.attn.extra.get("softcap", 0.0))
                       for layer in model.model.layers]
        self.rotary_keys = list(model.rotary.layer_keys)
        self.layer_lanes = list(model.kv_layout.layer_lanes)
        self._norm = kernels.raw("rms_norm", dtype)
        self._rope, self._silu = kernels.raw("rope_store", dtype), kernels.raw("silu_mul", dtype)
        self._attention = kernels.raw("paged_attention", dtype)
        self.limits = kernels.attention_limits()
        # A step of this many rows or more goes to the modules, where a GGUF layer decodes its matrix
        # for one GEMM (faster there from that size: worker/runner/cpu/gguf_linear.py).
        self.gemm_rows = min((m.scratch.gemm_rows.get(dtype, sys.maxsize) for layer in model.model.layers
                              for m in _matrices(layer) if type(m) is GgufLinear), default=sys.maxsize)

    @classmethod
    def of(cls, model: CausalLM, kernels: NativeLayerOps | None, kv_quantized: bool) -> NativeStack | None:
        """The stack of ``model``, or None where any layer is not entirely the kernels' (or the cache is
        quantized: its keys are turned between the rotary and the store)."""
        layers = list(model.model.layers)
        if (kernels is None or kv_quantized or not layers or type(model).forward is not CausalLM.forward
                or not all(_runs_entirely(layer) for layer in layers)):
            return None
        dtype = layers[0].input_layernorm.weight.dtype
        shapes = {(layer.self_attn.num_heads, layer.self_attn.num_kv_heads, layer.self_attn.head_dim,
                   layer.mlp.gate_up_proj.out_features) for layer in layers}
        # what the module path's kernels would check at each call: the model's dtype, on the CPU
        at_dtype = [t for layer in layers for t in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                                    *(m.bias for m in _matrices(layer)
                                                      if type(m) in (Int8Linear, PanelLinear) and m.bias is not None))]
        if (len(shapes) != 1 or dtype not in (torch.float32, torch.bfloat16)
                or any(t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() for t in at_dtype)):
            return None
        kinds = {type(m): m for layer in layers for m in _matrices(layer) if type(m) is not Int8Linear or m.kernels is None}
        if not all(_gives_packed_rows(m, dtype) for m in kinds.values()):
            return None
        return cls(model, kernels, dtype)

    def adapt(self, step: LoraStep) -> None:
        """Add the LoRA updates of ``step``'s rows after every matrix (``worker/runner/lora/adapters.py``)."""
        self.layers = [replace(layer, **{name: _AdaptedMatrix(getattr(layer, name), key, step)
                                         for name, key in zip(("qkv", "o", "gate_up", "down"), layer_keys(i))})
                       for i, layer in enumerate(self.layers)]

    def takes(self, x: torch.Tensor, tables: dict, meta: AttentionMetadata, kv_caches: list) -> bool:
        """Whether this step is one the stack runs: decodes, and rows of at most ``SHORT_ROW`` tokens
        (a draft being checked), at the model's dtype, a whole-head rotary, caches the kernels read."""
        t = x.shape[0]
        if (t == 0 or t >= self.gemm_rows or (meta.num_decodes != t and meta.prefill_max_query_len > SHORT_ROW)
                or x.dtype != self.dtype or x.device.type != "cpu"):
            return False
        k_cache = kv_caches[0][0]
        _, block_size, kv_heads, dim = k_cache.shape
        max_dim, max_group, max_block = self.limits
        if (k_cache.dtype != self.dtype or kv_heads != self.kv_heads or dim != self.dim or block_size > max_block
                or self.heads // self.kv_heads > max_group or self.dim > max_dim):
            return False
        for cos, sin in tables.values():
            if (cos.dtype != self.dtype or cos.shape[-1] != self.dim or not cos.is_contiguous() or not sin.is_contiguous()
                    or cos.shape[0] != t):
                return False
        return all(k.is_contiguous() and v.is_contiguous() and k.shape == k_cache.shape and k.dtype == k_cache.dtype
                   and v.shape == k.shape and v.dtype == k.dtype for k, v in kv_caches)

    def __call__(self, x: torch.Tensor, tables: dict, meta: AttentionMetadata, kv_caches: list) -> torch.Tensor | None:
        """The hidden states after the last layer (before the final norm), or None: the module path runs."""
        if not self.takes(x, tables, meta, kv_caches):
            return None
        t, hidden, threads = x.shape[0], self.hidden, torch.get_num_threads()
        block_size = kv_caches[0][0].shape[1]
        lanes = []  # each lane's (tables, seen positions, slots)
        for lane in range(max(self.layer_lanes) + 1):
            lane_meta = meta.lane(lane)
            block_tables, seq_lens = token_contexts(lane_meta, t)
            check_tables(block_tables, seq_lens, t)
            if int(seq_lens.max()) > block_tables.shape[1] * block_size:
                raise ValueError(f"a context of {int(seq_lens.max())} tokens does not fit block tables of "
                                 f"{block_tables.shape[1]} blocks of {block_size}")
            lanes.append((block_tables, seq_lens, lane_meta.slot_mapping.contiguous()))
        token_seq = torch.arange(t, dtype=torch.int32, device=x.device)
        q_width, kv_width = self.heads * self.dim, self.kv_heads * self.dim
        qkv_width = q_width + 2 * kv_width
        x = x.contiguous().clone()
        empty = lambda *shape: torch.empty(shape, dtype=self.dtype, device=x.device)  # noqa: E731
        h, qkv_rows, attended, out_rows, gate_up_rows, act = (
            empty(t, hidden), empty(t, qkv_width), empty(t, q_width), empty(t, hidden), empty(t, 2 * self.inter),
            empty(t, self.inter))
        q = empty(t, q_width) if t > 1 else None  # the attention kernel reads q's rows packed
        size = x.element_size()
        x_ptr, h_ptr, attended_ptr, act_ptr = x.data_ptr(), h.data_ptr(), attended.data_ptr(), act.data_ptr()
        for layer, (k_cache, v_cache), key, lane in zip(self.layers, kv_caches, self.rotary_keys, self.layer_lanes):
            cos, sin = tables[key]
            block_tables, seq_lens, slots = lanes[lane]
            self._norm(x_ptr, layer.norm_in, h_ptr, t, hidden, hidden, layer.eps_in, threads)
            qkv = layer.qkv(h, qkv_rows)
            qkv_ptr = qkv.data_ptr()
            self._rope(qkv_ptr, qkv_ptr + q_width * size, qkv_ptr + (q_width + kv_width) * size, qkv_width,
                       cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), t,
                       self.heads, self.kv_heads, self.dim, threads)
            if q is not None:
                q.copy_(qkv[:, :q_width])
            self._attention(qkv_ptr if q is None else q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                            block_tables.data_ptr(), block_tables.stride(0), token_seq.data_ptr(), seq_lens.data_ptr(),
                            attended_ptr, t, self.heads, self.kv_heads, self.dim, block_size, layer.scale, layer.window,
                            layer.softcap, None, threads)
            x.add_(layer.o(attended, out_rows))
            self._norm(x_ptr, layer.norm_post, h_ptr, t, hidden, hidden, layer.eps_post, threads)
            gate_up = layer.gate_up(h, gate_up_rows)  # held while the kernel reads it (a module's result is new)
            self._silu(gate_up.data_ptr(), act_ptr, t, self.inter, threads)
            x.add_(layer.down(act, out_rows))
        return x
