"""CPU paged attention through the C kernel in ``csrc/paged_attention.c``: decode and chunked
prefill read K/V through the block tables, with no gathered copy of any context.

The kernel takes, for every query token, its sequence and how many positions it sees (the whole
context for a decode token, the positions up to its own for a prefill token). Float32 and bfloat16
run natively, over a cache of the same dtype or a quantized one (one-byte codes decoded through the
format's table inside the loop, ``paged_kernels/kv_format.py``); other dtypes and shapes past the
kernel's limits go to the torch reference.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import NamedTuple

import torch

from pagedserve.kernels import reference
from pagedserve.kernels.checks import check_same, check_tables
from pagedserve.kernels.kv_format import AUTO, KVFormat
from pagedserve.kernels.native_build import load_library

QUANTIZED_KERNELS = {"int8": "i8"}  # format -> kernel suffix; the others decode by table
# what csrc/paged_prefill_bf16.c's paged_prefill_pairs_kind() says runs bfloat16 prefill
PREFILL_KINDS = {0: "vectors", 1: "AVX512-BF16 pairs (bf16)", 2: "AMX tiles (bf16)"}
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p


class ChunkTokens(NamedTuple):
    """Each token of a step's prefill chunks (int64 tensors)."""

    chunk: torch.Tensor  # [tokens]: its chunk (its sequence's row of the block tables)
    offset: torch.Tensor  # [tokens]: its place in its chunk
    lengths: torch.Tensor  # [chunks]: each chunk's tokens
    seen: torch.Tensor  # [tokens]: the positions it attends (its own and the ones before it)


def chunk_tokens(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int) -> ChunkTokens:
    """The chunks' tokens one by one: ``query_start_loc`` ``[chunks + 1]`` offsets of the chunks,
    ``seq_lens`` each chunk's sequence length with it, ``num_tokens`` their tokens in all."""
    starts = query_start_loc.long()
    lengths = starts[1:] - starts[:-1]
    chunk = torch.repeat_interleave(torch.arange(lengths.shape[0], device=starts.device), lengths, output_size=num_tokens)
    offset = torch.arange(num_tokens, device=starts.device) - starts[chunk]
    first_position = seq_lens.long() - lengths  # each chunk's first token's position in its sequence
    return ChunkTokens(chunk, offset, lengths, first_position[chunk] + offset + 1)


class NativeAttention:
    """Decode and prefill launchers over one loaded library; the torch reference (with its own
    workspace) for what the kernel does not take."""

    def __init__(self, cache_dir: Path, kv_format: KVFormat = AUTO, pair_products: bool = True) -> None:
        """``pair_products`` False keeps bfloat16 prefill on the vector kernel (the benchmarks' "before")."""
        self._lib = self.lib = load_library("paged_attention", cache_dir)  # the layer kernels are in it too
        self.kv_format = kv_format
        if kv_format.quantized:
            # arithmetic decoding where there is one, else the table
            suffix = "_" + QUANTIZED_KERNELS.get(kv_format.name, "q8")
            self._table = kv_format.table("cpu").contiguous()
        else:
            suffix, self._table = "", None
        self._kernels = {dtype: getattr(self._lib, f"paged_attention_{name}{suffix}") for dtype, name in _DTYPES.items()}
        self._prefill_kernels = self._vector_prefill = {dtype: getattr(self._lib, f"paged_prefill_{name}{suffix}")
                                                        for dtype, name in _DTYPES.items()}
        # bfloat16 over a bfloat16 cache on pair products (csrc/paged_prefill_bf16.c): AMX tiles where the CPU
        # has them and Linux grants them, else AVX512-BF16 vectors where it has those; head sizes of a multiple of 32
        pair_rows = _I64()
        kind = 0 if kv_format.quantized or not pair_products else int(self._lib.paged_prefill_pairs_kind(ctypes.byref(pair_rows)))
        self.prefill_kind = PREFILL_KINDS[kind]
        self._pair_rows = pair_rows.value if kind else None  # the rows a task holds there (the tiles' or the vectors')
        if kind:
            kernel = self._lib.paged_prefill_bf16_amx if kind == 2 else self._lib.paged_prefill_bf16_dot
            self._prefill_kernels = {**self._prefill_kernels, torch.bfloat16: kernel}
        limits = [_I64(), _I64(), _I64()]
        self._lib.paged_attention_limits(*(ctypes.byref(x) for x in limits))
        self._max_dim, self._max_group, self._max_block = (x.value for x in limits)
        rows = _I64()
        self._lib.paged_prefill_limits(ctypes.byref(rows))
        self._max_rows = rows.value
        self._workspace = reference.Workspace()

    def supports(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        heads, (_, block_size, kv_heads, _) = q.shape[1], k_cache.shape
        dim = self.kv_format.head_dim(k_cache)
        return (q.device.type == "cpu" and q.dtype in self._kernels
                and k_cache.dtype == self.kv_format.storage_dtype(q.dtype)
                and heads % kv_heads == 0 and heads // kv_heads <= self._max_group and dim <= self._max_dim
                and block_size <= self._max_block)

    def decode(self, q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len=None, window=0, softcap=0.0):
        """Same contract as ``reference.paged_attention_decode``."""
        if not self.supports(q, k_cache):
            return reference.paged_attention_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len,
                                                    self._workspace, window, softcap, self.kv_format)
        check_tables(block_tables, seq_lens, q.shape[0])
        token_seq = torch.arange(q.shape[0], dtype=torch.int32, device=q.device)
        return self._run(self._kernels, q, k_cache, v_cache, block_tables, token_seq, seq_lens, scale, window, softcap)

    def prefill(self, q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len=None,
                max_seq_len=None, window=0, softcap=0.0):
        """Same contract as ``reference.prefill_attention``."""
        if not self.supports(q, k_cache):
            return reference.prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                                               max_query_len, max_seq_len, self._workspace, window, softcap,
                                               self.kv_format)
        check_tables(block_tables, seq_lens, query_start_loc.shape[0] - 1)
        tokens = chunk_tokens(query_start_loc, seq_lens, q.shape[0])
        pairs = self._pair_rows is not None and q.dtype == torch.bfloat16 and q.shape[-1] % 32 == 0
        kernels, rows = (self._prefill_kernels, self._pair_rows) if pairs else (self._vector_prefill, self._max_rows)
        # Tiles of consecutive tokens of one sequence, as many as the kernel's rows hold with the group.
        tile = max(1, rows // (q.shape[1] // k_cache.shape[2]))
        first = torch.nonzero(tokens.offset % tile == 0).flatten()
        length = (tokens.lengths[tokens.chunk[first]] - tokens.offset[first]).clamp_max(tile)
        tiles = (first.to(torch.int32).contiguous(), length.to(torch.int32).contiguous())
        return self._run(kernels, q, k_cache, v_cache, block_tables, tokens.chunk.to(torch.int32),
                         tokens.seen.to(torch.int32), scale, window, softcap, tiles)

    def _run(self, kernels, q, k_cache, v_cache, block_tables, token_seq, ctx_len, scale, window: int = 0,
             softcap: float = 0.0, tiles: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One kernel call: per token (``tiles`` None) or per tile of (first token, tokens)."""
        if k_cache.shape != v_cache.shape or v_cache.dtype != k_cache.dtype:
            raise ValueError(f"K and V caches differ: {tuple(k_cache.shape)} {k_cache.dtype} and "
                             f"{tuple(v_cache.shape)} {v_cache.dtype}")
        if q.shape[-1] != self.kv_format.head_dim(k_cache):
            raise ValueError(f"q head_dim {q.shape[-1]} != cache head_dim {self.kv_format.head_dim(k_cache)}")
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("caches must be contiguous")
        check_same(q.device, k_cache.device, v_cache.device, block_tables.device)
        q = q.contiguous()
        tables, ctx_len = block_tables.contiguous(), ctx_len.contiguous()
        out = torch.empty_like(q)
        num_tokens, heads, dim = q.shape
        _, block_size, kv_heads, _ = k_cache.shape
        if num_tokens and int(ctx_len.max()) > tables.shape[1] * block_size:  # would read past a table row
            raise ValueError(f"a context of {int(ctx_len.max())} tokens does not fit block tables of "
                             f"{tables.shape[1]} blocks of {block_size}")
        tiled = () if tiles is None else (_PTR(tiles[0].data_ptr()), _PTR(tiles[1].data_ptr()))
        tasks = num_tokens if tiles is None else tiles[0].shape[0]
        kernels[q.dtype](
            _PTR(q.data_ptr()), _PTR(k_cache.data_ptr()), _PTR(v_cache.data_ptr()), _PTR(tables.data_ptr()),
            _I64(tables.stride(0)), *tiled, _PTR(token_seq.data_ptr()), _PTR(ctx_len.data_ptr()), _PTR(out.data_ptr()),
            _I64(tasks), _I64(heads), _I64(kv_heads), _I64(dim), _I64(block_size), ctypes.c_float(scale),
            _I64(window), ctypes.c_float(softcap), _PTR(self._table.data_ptr() if self._table is not None else None),
            ctypes.c_int(torch.get_num_threads()),
        )
        return out
