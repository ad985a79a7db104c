"""A decode step's whole decoder stack as direct calls of the C kernels, where every layer is one the
kernels run entirely: the RMSNorms, the int8 q/k/v, o, gate/up and down matrices
(``csrc/int8_linear.c``), the rotary with the K/V store, the paged decode attention and SiLU.

Through the modules, a layer of a one-token step costs ~90 us of Python (module calls, argument
checks, views, an allocation per result) around ~80 us of kernels (SmolLM2, int8, 2 CPU cores,
docs/benchmarks.md). Here the checks run once per step, the results go to buffers allocated once per
step, and each layer is seven C calls and two in-place adds: the same kernels on the same inputs in
the same order, so the same bits as the module path (tested). Anything else (a prefill chunk in the
step, a quantized cache, another rotary, a layer with a norm or a matrix the kernels do not run)
takes the module path: ``NativeStack.of`` answers None for a model it cannot run, and a call answers
None for a step it does not take.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kernels.checks import check_tables
from pagedserve.kernels.native_layer_ops import NativeLayerOps
from pagedserve.worker.runner.attention import AttentionMetadata
from pagedserve.worker.runner.models.layers import MLP, Attention, CausalLM, DecoderLayer, RMSNorm
from pagedserve.worker.runner.quantized_linear import Int8Linear


@dataclass(frozen=True)
class _Matrix:
    panels: int  # the data pointers of the codes (panel layout), scales and bias (0: none)
    scale: int
    bias: int
    width: int  # outputs
    npanels: int


@dataclass(frozen=True)
class _Layer:
    norm_in: int
    norm_post: int
    qkv: _Matrix
    o: _Matrix
    gate_up: _Matrix
    down: _Matrix
    eps_in: float
    eps_post: float
    scale: float
    window: int
    softcap: float


def _matrix(linear) -> _Matrix | None:
    if type(linear) is not Int8Linear or linear.kernels is None:
        return None
    bias = linear.bias.data_ptr() if linear.bias is not None else 0
    return _Matrix(linear.codes.data_ptr(), linear.scale.data_ptr(), bias, linear.out_features, linear.codes.shape[0])


def _runs_entirely(layer) -> bool:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    return (type(layer) is DecoderLayer and type(attention) is Attention and attention.kernels is not None
            and attention.plain and type(mlp) is MLP and mlp.kernels is not None and mlp.gate_up_proj is not None
            and all(type(n) is RMSNorm and n.kernels is not None
                    for n in (layer.input_layernorm, layer.post_attention_layernorm))
            and all(_matrix(m) is not None for m in _matrices(layer)))


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
                              _matrix(layer.self_attn.qkv_proj), _matrix(layer.self_attn.o_proj),
                              _matrix(layer.mlp.gate_up_proj), _matrix(layer.mlp.down_proj),
                              layer.input_layernorm.eps, layer.post_attention_layernorm.eps, layer.self_attn.attn.scale,
                              layer.self_attn.attn.extra.get("window", 0), layer.self_attn.attn.extra.get("softcap", 0.0))
                       for layer in model.model.layers]
        self.rotary_keys = list(model.rotary.layer_keys)
        self._norm, self._linear = kernels.raw("rms_norm", dtype), kernels.raw("int8_linear", dtype)
        self._rope, self._silu = kernels.raw("rope_store", dtype), kernels.raw("silu_mul", dtype)
        self._attention = kernels.raw("paged_attention", dtype)
        self.limits = kernels.attention_limits()

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
                                                    *(m.bias for m in _matrices(layer) if m.bias is not None))]
        if (len(shapes) != 1 or dtype not in (torch.float32, torch.bfloat16)
                or any(t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() for t in at_dtype)):
            return None
        return cls(model, kernels, dtype)

    def takes(self, x: torch.Tensor, tables: dict, meta: AttentionMetadata, kv_caches: list) -> bool:
        """Whether this step is one the stack runs: decodes only, at the model's dtype, a whole-head
        rotary, caches the kernels read."""
        t = x.shape[0]
        if t == 0 or meta.num_decodes != t or x.dtype != self.dtype or x.device.type != "cpu":
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
        block_tables, seq_lens = meta.decode_block_tables.contiguous(), meta.decode_seq_lens.contiguous()
        check_tables(block_tables, seq_lens, t)
        block_size = kv_caches[0][0].shape[1]
        if int(seq_lens.max()) > block_tables.shape[1] * block_size:
            raise ValueError(f"a context of {int(seq_lens.max())} tokens does not fit block tables of "
                             f"{block_tables.shape[1]} blocks of {block_size}")
        slots = meta.slot_mapping.contiguous()
        token_seq = torch.arange(t, dtype=torch.int32, device=x.device)
        q_width, kv_width = self.heads * self.dim, self.kv_heads * self.dim
        qkv_width = q_width + 2 * kv_width
        x = x.contiguous().clone()
        empty = lambda *shape: torch.empty(shape, dtype=self.dtype, device=x.device)  # noqa: E731
        h, qkv, attended, out, gate_up, act = (empty(t, hidden), empty(t, qkv_width), empty(t, q_width), empty(t, hidden),
                                               empty(t, 2 * self.inter), empty(t, self.inter))
        q = empty(t, q_width) if t > 1 else qkv  # the attention kernel reads q's rows packed
        size = x.element_size()
        ptr = {name: buffer.data_ptr() for name, buffer in
               (("x", x), ("h", h), ("qkv", qkv), ("q", q), ("attended", attended), ("out", out), ("gate_up", gate_up),
                ("act", act))}
        for layer, (k_cache, v_cache), key in zip(self.layers, kv_caches, self.rotary_keys):
            cos, sin = tables[key]
            self._norm(ptr["x"], layer.norm_in, ptr["h"], t, hidden, hidden, layer.eps_in, threads)
            self._matmul(layer.qkv, ptr["h"], ptr["qkv"], t, hidden, threads)
            self._rope(ptr["qkv"], ptr["qkv"] + q_width * size, ptr["qkv"] + (q_width + kv_width) * size, qkv_width,
                       cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(), t,
                       self.heads, self.kv_heads, self.dim, threads)
            if t > 1:
                q.copy_(qkv[:, :q_width])
            self._attention(ptr["q"], k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                            block_tables.stride(0), token_seq.data_ptr(), seq_lens.data_ptr(), ptr["attended"], t,
                            self.heads, self.kv_heads, self.dim, block_size, layer.scale, layer.window, layer.softcap,
                            None, threads)
            self._matmul(layer.o, ptr["attended"], ptr["out"], t, q_width, threads)
            x.add_(out)
            self._norm(ptr["x"], layer.norm_post, ptr["h"], t, hidden, hidden, layer.eps_post, threads)
            self._matmul(layer.gate_up, ptr["h"], ptr["gate_up"], t, hidden, threads)
            self._silu(ptr["gate_up"], ptr["act"], t, self.inter, threads)
            self._matmul(layer.down, ptr["act"], ptr["out"], t, self.inter, threads)
            x.add_(out)
        return x

    def _matmul(self, m: _Matrix, source: int, target: int, rows: int, width: int, threads: int) -> None:
        if self._linear(source, m.panels, m.scale, m.bias or None, target, rows, width, m.width, m.npanels, threads):
            raise MemoryError("the int8 kernel could not allocate its scratch rows")
