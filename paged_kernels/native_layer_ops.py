"""A decoder layer's small operations through the C kernels of ``csrc/layer_ops.c``: RMSNorm, rotary
embedding of q and k with the store of k and v into the cache, SiLU(gate) * up; the weight-only
int8 linear layer of ``csrc/int8_linear.c``, the float32 / bfloat16 one of ``csrc/float_linear.c`` and
the one that runs a GGUF file's quantized blocks as stored (``csrc/gguf_linear.c``).

At one token a step these are a layer's cost beyond its matrices: a dozen torch operations each, at
a few microseconds apiece, 30 layers a step (docs/benchmarks.md). Each method takes what the C code
takes (float32 or bfloat16 on the CPU, contiguous rows) and answers ``None`` (``rope_store``:
False) for anything else, so the layer runs its own torch code, which the tests hold the C to
(``tests/kernels/test_layer_ops.py``).
"""

from __future__ import annotations

import ctypes

import torch

from pagedserve.kernels.host_memory import huge_page_copy

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
PANEL = 32  # output channels side by side in the int8 and float32 kernels' layouts (csrc/*_linear.c)
_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES = {  # name -> (argument types, result type)
    "rms_norm": ((_PTR, _PTR, _PTR, _I64, _I64, _I64, _F32, _INT), None),
    "rope_store": ((_PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT), None),
    "silu_mul": ((_PTR, _PTR, _I64, _I64, _INT), None),
    "int8_linear": ((_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT), _INT),  # 0, or -1: no scratch memory
    # csrc/paged_attention.c over a cache at the model's dtype (NativeAttention launches it with its checks)
    "paged_attention": ((_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _F32, _I64, _F32,
                         _PTR, _INT), None),
    "float_linear": ((_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT), _INT),  # 0, or -1: no scratch memory
    # 0; -1: no scratch memory; -2: a type or width it does not run
    "gguf_linear": ((_PTR, _PTR, _INT, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT), _INT),
    "gguf_linear_x8": ((_PTR, _PTR, _INT, _PTR, _PTR, _I64, _I64, _I64, _I64, _INT), _INT),  # as gguf_linear
    "gguf_dequantize_rows": ((_PTR, _INT, _PTR, _I64, _I64, _PTR, _INT), None),
}
GGUF_KERNEL_TYPES = {"Q8_0": 8, "Q4_K": 12, "Q6_K": 14}  # GGUF block formats csrc/gguf_linear.c runs, by ggml id
GGUF_X8_TYPES = (12, 14)  # those csrc/gguf_x8.c runs with int8 inputs (Q4_K, Q6_K)


class NativeLayerOps:
    """The layer kernels of one loaded kernel library (``native_build.load_library``)."""

    def __init__(self, lib: ctypes.CDLL, names: tuple[str, ...] = tuple(_SIGNATURES)) -> None:
        self._lib = lib
        self._fns: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] = {}
        for name in names:
            argtypes, restype = _SIGNATURES[name]
            for dtype, suffix in _DTYPES.items():
                fn = lib[f"{name}_{suffix}"]  # an object of its own: NativeAttention calls the same symbol its way
                fn.argtypes, fn.restype = argtypes, restype
                self._fns[name, dtype] = fn
        runs = getattr(lib, "gguf_x8_runs", None)  # absent from a library built without csrc/gguf_x8.c
        self._x8_runs = "gguf_linear_x8" in names and runs is not None and bool(runs())

    def raw(self, name: str, dtype: torch.dtype) -> ctypes._CFuncPtr:
        """The C function itself (arguments as ``_SIGNATURES`` says, pointers as ints), for a caller
        that has made every check its wrapper makes (``worker/runner/cpu/native_stack.py``)."""
        return self._fns[name, dtype]

    def attention_limits(self) -> tuple[int, int, int]:
        """The attention kernel's largest head_dim, GQA group and block size."""
        limits = [ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()]
        self._lib.paged_attention_limits(*(ctypes.byref(x) for x in limits))
        return tuple(x.value for x in limits)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension of a ``[rows, dim]`` ``x``
        whose rows are contiguous."""
        fn = self._fns.get(("rms_norm", x.dtype))
        if (fn is None or x.device.type != "cpu" or x.dim() != 2 or x.stride(1) != 1 or weight.dtype != x.dtype
                or not weight.is_contiguous()):
            return None
        rows, dim = x.shape
        out = torch.empty((rows, dim), dtype=x.dtype, device=x.device)
        fn(x.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, dim, x.stride(0), eps, torch.get_num_threads())
        return out

    def rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> bool:
        """Rotate q ``[T, heads, dim]`` and k ``[T, kv_heads, dim]`` in place (cos and sin
        ``[T, 1, dim]``, the whole head rotated) and store k and v ``[T, kv_heads, dim]`` into the
        caches' slots (``slot_mapping``, int64, -1: not stored). q, k and v are views of one
        projection's rows (one row stride, each head's values contiguous). False, touching
        nothing, where the kernel does not apply."""
        fn = self._fns.get(("rope_store", q.dtype))
        tokens, heads, dim = q.shape
        stride = q.stride(0)
        if (fn is None or q.device.type != "cpu" or not all(_heads_of_rows(x, stride, dim) for x in (q, k, v))
                or k.dtype != q.dtype or v.dtype != q.dtype or cos.dtype != q.dtype or sin.dtype != q.dtype
                or cos.shape[-1] != dim or not (cos.is_contiguous() and sin.is_contiguous())
                or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype or slots.dtype != torch.int64
                or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
            return False
        fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), stride, cos.data_ptr(), sin.data_ptr(), k_cache.data_ptr(),
           v_cache.data_ptr(), slots.data_ptr(), tokens, heads, k.shape[1], dim, torch.get_num_threads())
        return True

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """``silu(gate) * up`` of a contiguous ``[rows, 2 * inter]`` (gate first, then up)."""
        fn = self._fns.get(("silu_mul", gate_up.dtype))
        if fn is None or gate_up.device.type != "cpu" or gate_up.dim() != 2 or not gate_up.is_contiguous():
            return None
        rows, width = gate_up.shape
        out = torch.empty((rows, width // 2), dtype=gate_up.dtype, device=gate_up.device)
        fn(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, torch.get_num_threads())
        return out

    @staticmethod
    def int8_panels(codes: torch.Tensor) -> torch.Tensor:
        """int8 ``codes`` ``[out, in]`` in the int8 kernel's layout: ``PANEL`` output channels side by
        side, then pairs of inputs, ``[ceil(out / PANEL), ceil(in / 2), PANEL, 2]`` (zeros where ``out``
        falls short of whole panels or ``in`` is odd)."""
        outs, width = codes.shape
        panels = -(-outs // PANEL)
        padded = _padded(codes, panels * PANEL, width + width % 2)
        return huge_page_copy(padded.view(panels, PANEL, -1, 2).transpose(1, 2))

    @staticmethod
    def int8_codes(panels: torch.Tensor, outs: int, width: int) -> torch.Tensor:
        """``int8_panels`` undone: the ``[outs, width]`` codes."""
        return panels.transpose(1, 2).reshape(-1, panels.shape[1] * 2)[:outs, :width]

    def int8_linear(self, x: torch.Tensor, panels: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor | None:
        """``x`` ``[rows, in]`` times int8 codes in ``int8_panels``' layout with a bfloat16 ``scale``
        per output (``[out]``; and ``bias`` at x's dtype) -> ``[rows, out]`` at x's dtype."""
        fn = self._fns.get(("int8_linear", x.dtype))
        if (fn is None or x.device.type != "cpu" or x.dim() != 2 or not x.is_contiguous() or panels.dtype != torch.int8
                or not panels.is_contiguous() or scale.dtype != torch.bfloat16 or not scale.is_contiguous()
                or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))):
            return None
        rows, width = x.shape
        outs = scale.shape[0]
        if panels.shape != (-(-outs // PANEL), (width + 1) // 2, PANEL, 2):
            raise ValueError(f"int8 panels of shape {tuple(panels.shape)} do not hold {outs} x {width} codes")
        out = torch.empty((rows, outs), dtype=x.dtype, device=x.device)
        failed = fn(x.data_ptr(), panels.data_ptr(), scale.data_ptr(), bias.data_ptr() if bias is not None else None,
                    out.data_ptr(), rows, width, outs, panels.shape[0], torch.get_num_threads())
        return None if failed else out


    @staticmethod
    def float_panels(weight: torch.Tensor) -> torch.Tensor:
        """A float32 or bfloat16 ``weight`` ``[out, in]`` in the float kernels' layout
        (``csrc/float_linear.c``), at the weight's dtype: ``PANEL`` output channels side by side per
        input, ``[ceil(out / PANEL), in, PANEL]`` in float32, per pair of inputs ``[ceil(out / PANEL),
        ceil(in / 2), PANEL, 2]`` in bfloat16 (zeros where ``out`` falls short of whole panels or
        ``in`` is odd)."""
        outs, width = weight.shape
        panels = -(-outs // PANEL)
        pairs = weight.dtype == torch.bfloat16
        padded = _padded(weight, panels * PANEL, width + (width % 2 if pairs else 0))
        if pairs:
            return huge_page_copy(padded.view(panels, PANEL, -1, 2).transpose(1, 2))
        return huge_page_copy(padded.view(panels, PANEL, width).transpose(1, 2))

    def float_linear(self, x: torch.Tensor, panels: torch.Tensor, outs: int,
                     bias: torch.Tensor | None) -> torch.Tensor | None:
        """``x`` ``[rows, in]`` times a weight in ``float_panels``' layout (+ ``bias``), all float32 or
        all bfloat16 (computed in float32, the output rounded once) -> ``[rows, outs]``; None for what
        the kernel does not take."""
        fn = self._fns.get(("float_linear", x.dtype))
        if (fn is None or x.device.type != "cpu" or x.dim() != 2 or not x.is_contiguous()
                or panels.dtype != x.dtype or not panels.is_contiguous()
                or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))):
            return None
        rows, width = x.shape
        expected = (-(-outs // PANEL), (width + 1) // 2, PANEL, 2) if x.dtype == torch.bfloat16 else (-(-outs // PANEL), width, PANEL)
        if panels.shape != expected:
            raise ValueError(f"float panels of shape {tuple(panels.shape)} do not hold {outs} x {width} weights")
        out = torch.empty((rows, outs), dtype=x.dtype, device=x.device)
        failed = fn(x.data_ptr(), panels.data_ptr(), bias.data_ptr() if bias is not None else None, out.data_ptr(),
                    rows, width, outs, panels.shape[0], torch.get_num_threads())
        return None if failed else out


    def gguf_linear(self, x: torch.Tensor, blocks: torch.Tensor, gguf_type: int, bias: torch.Tensor | None,
                    out: torch.Tensor, int8_inputs: bool = False) -> bool:
        """``out`` (a ``[rows, n]`` view whose rows are contiguous, e.g. a fused layer's columns) =
        ``x`` ``[rows, in]`` times the quantized matrix ``blocks`` (uint8 ``[n, row bytes]``, the
        file's blocks of ``gguf_type``) (+ ``bias``); False, touching nothing, for what the kernel
        does not take. ``int8_inputs``: ``x`` taken to int8 per 256 values (``csrc/gguf_x8.c``) where
        ``gguf_x8_runs`` this format, else to int16."""
        name = "gguf_linear_x8" if int8_inputs and self.gguf_x8_runs(gguf_type) else "gguf_linear"
        fn = self._fns.get((name, x.dtype))
        rows, width = x.shape
        if (fn is None or x.device.type != "cpu" or not x.is_contiguous() or blocks.dtype != torch.uint8
                or not blocks.is_contiguous() or out.dtype != x.dtype or out.shape != (rows, blocks.shape[0])
                or (out.stride(1) != 1 and out.shape[1] > 1)
                or (bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()))):
            return False
        failed = fn(x.data_ptr(), blocks.data_ptr(), gguf_type, bias.data_ptr() if bias is not None else None,
                    out.data_ptr(), rows, width, out.shape[1], out.stride(0), torch.get_num_threads())
        if failed == -1:
            raise MemoryError("the GGUF kernel could not allocate its scratch rows")
        return failed == 0

    def gguf_x8_runs(self, gguf_type: int) -> bool:
        """Whether ``csrc/gguf_x8.c`` (int8 inputs) runs blocks of ``gguf_type`` here: Q4_K and Q6_K, on a
        CPU with AVX-512 BW and VNNI."""
        return self._x8_runs and gguf_type in GGUF_X8_TYPES

    def gguf_tile_rows(self) -> int:
        """From how many rows ``gguf_linear`` multiplies a bfloat16 batch on AMX tiles here
        (``csrc/gguf_amx.c``); 0: never (no tiles on this CPU, or a library built without them)."""
        fn = getattr(self._lib, "gguf_amx_rows", None)
        return 0 if fn is None else int(fn())

    def gguf_rows(self, blocks: torch.Tensor, gguf_type: int, ids: torch.Tensor | None, width: int,
                  dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Rows ``ids`` (None: every row) of the quantized matrix ``blocks`` decoded to ``dtype``
        ``[rows, width]`` (an embedding's lookups; a matrix for a batch's GEMM), into ``out`` where
        given (contiguous); None for what the kernel does not take."""
        fn = self._fns.get(("gguf_dequantize_rows", dtype))
        if fn is None or blocks.device.type != "cpu" or not blocks.is_contiguous() or blocks.dtype != torch.uint8:
            return None
        flat = None if ids is None else ids.reshape(-1).to(torch.int64).contiguous()
        rows = blocks.shape[0] if flat is None else flat.numel()
        if out is None:
            out = torch.empty((rows, width), dtype=dtype)
        elif out.shape != (rows, width) or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"GGUF rows go into a contiguous {dtype} [{rows}, {width}], not {tuple(out.shape)}")
        fn(blocks.data_ptr(), gguf_type, None if flat is None else flat.data_ptr(), rows, width, out.data_ptr(),
           torch.get_num_threads())
        return out


def _heads_of_rows(x: torch.Tensor, stride: int, dim: int) -> bool:
    """``x`` ``[T, heads, dim]`` lays each token's heads side by side, ``dim`` values each, tokens
    ``stride`` elements apart (a dimension of size 0 or 1 may carry any stride)."""
    tokens, heads, width = x.shape
    return (width == dim and (width <= 1 or x.stride(2) == 1) and (heads <= 1 or x.stride(1) == dim)
            and (tokens <= 1 or x.stride(0) == stride))


def _padded(matrix: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``matrix`` with zero rows and columns up to ``rows`` x ``cols``; itself where none are needed
    (a model's largest matrix is not copied once more on its way into panels)."""
    if matrix.shape == (rows, cols) and matrix.is_contiguous():
        return matrix
    padded = torch.zeros((rows, cols), dtype=matrix.dtype, device=matrix.device)
    padded[:matrix.shape[0], :matrix.shape[1]] = matrix
    return padded
