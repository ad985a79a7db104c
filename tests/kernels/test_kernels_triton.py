"""Each Triton kernel against its torch reference: under TRITON_INTERPRET=1 on the CPU, and on
CUDA (``gpu`` marker) when a device is present."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.kernels.triton_devices import DEVICES  # first: it picks the interpreter on a CPU

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from pagedserve.kernels import reference as ref  # noqa: E402
from pagedserve.kernels.copy_blocks import copy_blocks  # noqa: E402
from pagedserve.kernels.fused_moe import align_by_expert, fused_moe  # noqa: E402
from pagedserve.kernels.kv_format import kv_format  # noqa: E402
from pagedserve.kernels.moe_reference import grouped_moe  # noqa: E402
from pagedserve.kernels.paged_tiles import _load_codes, code_constants  # noqa: E402
from pagedserve.kernels.paged_attention import paged_attention_decode  # noqa: E402
from pagedserve.kernels.prefill_attention import prefill_attention  # noqa: E402
from pagedserve.kernels.store_kv import store_kv  # noqa: E402
from tests.paged_cases import TOLERANCE, make_case, quantized_case  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def close(actual, expected, dtype):
    tol = TOLERANCE[dtype] * 2
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=tol, rtol=tol)


def check_prefill(case, q: torch.Tensor, q_lens: list[int], scale: float, dtype: torch.dtype, **extra) -> None:
    """The prefill kernel on chunks of ``q_lens`` queries over ``case``'s cache against the torch reference."""
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
    out = prefill_attention(q, case.k_cache, case.v_cache, case.block_tables, starts, case.seq_lens, scale, **extra)
    expected = ref.prefill_attention(q.cpu(), case.k_cache.cpu(), case.v_cache.cpu(), case.block_tables.cpu(),
                                     starts.cpu(), case.seq_lens.cpu(), scale, **extra)
    close(out, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim,heads,kv_heads", [(16, 64, 4, 2), (1, 80, 2, 2), (8, 128, 8, 1), (16, 256, 2, 1)])
def test_decode(device, dtype, block_size, head_dim, heads, kv_heads):
    lengths = [1, 15, 16, 17, 100, 600]  # 600 crosses a 512-token partition: the split path and its reduce
    case = make_case(lengths, block_size, kv_heads, head_dim, dtype, device)
    q = torch.randn(len(lengths), heads, head_dim).to(dtype).to(device)
    out = paged_attention_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.1)
    expected = ref.paged_attention_decode(q.cpu(), case.k_cache.cpu(), case.v_cache.cpu(), case.block_tables.cpu(),
                                          case.seq_lens.cpu(), 0.1)
    close(out, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("partition,window", [(128, 0), (256, 300), (512, 300)])
def test_decode_in_slices_of_any_size_reduced_in_chunks(device, partition, window):
    """Contexts of up to 40 slices of 128 (more than one chunk of the reduction), with and
    without a window that leaves early slices unwritten."""
    lengths = [1, 127, 128, 129, 700, 5000]
    case = make_case(lengths, 16, 2, 64, torch.float32, device)
    q = torch.randn(len(lengths), 4, 64).to(device) * 2
    out = paged_attention_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.1, window=window,
                                 partition=partition)
    expected = ref.paged_attention_decode(q.cpu(), case.k_cache.cpu(), case.v_cache.cpu(), case.block_tables.cpu(),
                                          case.seq_lens.cpu(), 0.1, window=window)
    close(out, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,head_dim,heads,kv_heads", [(16, 64, 4, 2), (4, 96, 3, 1)])
def test_prefill_with_cached_prefix(device, dtype, block_size, head_dim, heads, kv_heads):
    seq_lens, q_lens = [5, 33, 48, 70], [5, 1, 16, 37]  # whole prompts, a one-token chunk, chunks after a prefix
    case = make_case(seq_lens, block_size, kv_heads, head_dim, dtype, device)
    q = torch.randn(sum(q_lens), heads, head_dim).to(dtype).to(device)
    check_prefill(case, q, q_lens, 0.125, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,window,softcap", [(8, 2, 0, 0.0), (6, 2, 5, 0.0), (14, 2, 0, 3.0), (4, 4, 0, 0.0)])
def test_short_chunks_share_each_kv_tile_across_the_groups_heads(device, dtype, heads, kv_heads, window, softcap):
    """Chunks of up to 8 tokens (a step checking drafts, a prompt's last tokens) after cached
    prefixes: a KV head's query heads packed into one program's rows (groups of 4, 3 and 7 padded to
    4 and 8; windows; soft-capping), what the reference gives; one head per KV head takes the plain
    tiles."""
    from pagedserve.kernels.prefill_attention import packed_tiles

    seq_lens, q_lens = [3, 40, 100, 17], [3, 5, 8, 1]
    assert (packed_tiles(64, max(q_lens), heads // kv_heads) is None) == (heads == kv_heads)
    case = make_case(seq_lens, 16, kv_heads, 64, dtype, device)
    q = torch.randn(sum(q_lens), heads, 64).to(dtype).to(device) * 2
    check_prefill(case, q, q_lens, 0.125, dtype, window=window, softcap=softcap)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window,softcap", [(1, 0.0), (16, 0.0), (33, 3.0), (520, 0.0), (0, 3.0)])
def test_sliding_window_and_soft_capped_decode_and_prefill(device, window, softcap):
    """Windows shorter than a tile, across tiles, and past a 512-token partition (slices before
    the window write nothing and the reduce must not read them)."""
    lengths = [1, 9, 16, 17, 40, 97, 600, 1100]
    case = make_case(lengths, 16, 2, 64, torch.float32, device)
    q = torch.randn(len(lengths), 4, 64).to(device) * 3
    out = paged_attention_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.1, window=window,
                                 softcap=softcap)
    expected = ref.paged_attention_decode(q.cpu(), case.k_cache.cpu(), case.v_cache.cpu(), case.block_tables.cpu(),
                                          case.seq_lens.cpu(), 0.1, window=window, softcap=softcap)
    close(out, expected, torch.float32)
    seq_lens, q_lens = [5, 33, 48, 70], [5, 1, 16, 37]
    case = make_case(seq_lens, 4, 1, 32, torch.float32, device)
    q = torch.randn(sum(q_lens), 3, 32).to(device) * 3
    check_prefill(case, q, q_lens, 0.125, torch.float32, window=window, softcap=softcap)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (100, 2.5)])
def test_long_chunks_mask_only_the_tiles_on_the_diagonal_and_the_windows_edge(device, window, softcap):
    """Chunks of several 128-row query tiles (64-key tiles) after prefixes: a tile's keys below its
    first row and inside its last row's window go unmasked, the window's edge and the diagonal
    masked, whatever the window's size against the tiles."""
    seq_lens, q_lens = [300, 457, 700, 130], [300, 257, 65, 129]
    case = make_case(seq_lens, 16, 2, 64, torch.float32, device)
    q = torch.randn(sum(q_lens), 4, 64).to(device) * 2
    check_prefill(case, q, q_lens, 0.125, torch.float32, window=window, softcap=softcap)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_with_skipped_slots(device, dtype):
    k_cache = torch.zeros(6, 4, 2, 80, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(5, 2, 80).to(dtype).to(device)
    value = torch.randn(5, 2, 80).to(dtype).to(device)
    slots = torch.tensor([3, -1, 23, 0, -1], device=device)
    store_kv(key, value, k_cache, v_cache, slots)
    k_ref, v_ref = torch.zeros_like(k_cache).cpu(), torch.zeros_like(v_cache).cpu()
    ref.store_kv(key.cpu(), value.cpu(), k_ref, v_ref, slots.cpu())
    assert torch.equal(k_cache.cpu(), k_ref) and torch.equal(v_cache.cpu(), v_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("block_size,window,softcap", [(1, 0, 0.0), (16, 0, 0.0), (16, 16, 0.0), (1, 0, 2.0)])
def test_quantized_cache_reads_as_the_decoded_cache(device, name, block_size, window, softcap):
    """Decode (across a 512-token partition) and prefill over one-byte rows: what plain attention
    over the whole cache decoded up front gives."""
    lengths = [1, 9, 16, 17, 97, 600]
    case, k_rows, v_rows = quantized_case(name, block_size, 2, lengths)
    fmt, rows = kv_format(name), (k_rows.to(device), v_rows.to(device))
    tables, lens = case.block_tables.to(device), case.seq_lens.to(device)
    q = torch.randn(len(lengths), 6, 64) * (3.0 if softcap else 1.0)
    out = paged_attention_decode(q.to(device), *rows, tables, lens, 0.125, window=window, softcap=softcap, kv_format=fmt)
    expected = ref.paged_attention_decode(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 0.125,
                                          window=window, softcap=softcap)
    close(out, expected, torch.float32)
    starts = torch.tensor([0, 1, 3, 8, 9, 25, 41], dtype=torch.int32)  # chunks of 1, 2, 5, 1, 16, 16 tokens
    qp = torch.randn(41, 6, 64)
    out = prefill_attention(qp.to(device), *rows, tables, starts.to(device), lens, 0.125, window=window,
                            softcap=softcap, kv_format=fmt)
    expected = ref.prefill_attention(qp, case.k_cache, case.v_cache, case.block_tables, starts, case.seq_lens, 0.125,
                                     window=window, softcap=softcap)
    close(out, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_aligned_rows_read_and_write_as_the_tight_ones(device, name):
    """CUDA's rows (codes, scale, 14 unused bytes: 16-byte aligned at a head of 64) hold what the
    tight rows hold: store writes the reference's aligned rows, and decode and prefill over them give
    the tight rows' outputs exactly."""
    tight = kv_format(name)
    fmt = kv_format(name, "cuda")
    assert fmt == tight.aligned() and fmt.tail == 16 and fmt.row_width(64) == 80 and tight.row_width(64) == 66
    case, k_rows, v_rows = quantized_case(name, 16, 2, [1, 17, 97, 600])
    pad = lambda rows: torch.cat([rows, rows.new_zeros((*rows.shape[:-1], 14))], dim=-1)  # noqa: E731
    aligned = (pad(k_rows).to(device), pad(v_rows).to(device))
    assert fmt.head_dim(aligned[0]) == 64 and torch.equal(fmt.dequantize(aligned[0].cpu()), tight.dequantize(k_rows))
    tables, lens = case.block_tables.to(device), case.seq_lens.to(device)
    q = torch.randn(4, 6, 64).to(device)
    assert torch.equal(paged_attention_decode(q, *aligned, tables, lens, 0.125, kv_format=fmt).cpu(),
                       paged_attention_decode(q, k_rows.to(device), v_rows.to(device), tables, lens, 0.125,
                                              kv_format=tight).cpu())
    starts = torch.tensor([0, 1, 3, 8, 24], dtype=torch.int32, device=device)
    qp = torch.randn(24, 6, 64).to(device)
    assert torch.equal(prefill_attention(qp, *aligned, tables, starts, lens, 0.125, kv_format=fmt).cpu(),
                       prefill_attention(qp, k_rows.to(device), v_rows.to(device), tables, starts, lens, 0.125,
                                         kv_format=tight).cpu())
    k_cache, v_cache = (torch.zeros(6, 4, 2, 80, dtype=torch.uint8, device=device) for _ in range(2))
    key, value, slots = torch.randn(5, 2, 64) * 4, torch.randn(5, 2, 64), torch.tensor([3, -1, 23, 0, -1])
    store_kv(key.to(device), value.to(device), k_cache, v_cache, slots.to(device), kv_format=fmt)
    k_ref, v_ref = torch.zeros_like(k_cache).cpu(), torch.zeros_like(v_cache).cpu()
    ref.store_kv(key, value, k_ref, v_ref, slots, kv_format=fmt)
    assert torch.equal(k_cache.cpu(), k_ref) and torch.equal(v_cache.cpu(), v_ref) and not k_ref[..., 66:].any()


@triton.jit
def _decode_every_code(codes_ptr, out_ptr, CODE: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr):
    rows, d = tl.arange(0, 16), tl.arange(0, 16)
    offs = rows * 18  # 16 codes and a scale a row
    values, _ = _load_codes(codes_ptr, offs, d, rows < 16, (rows < 16)[:, None] & (d < 16)[None, :], 16, CODE, MANT,
                            BIAS)
    tl.store(out_ptr + rows[:, None] * 16 + d[None, :], values)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_every_code_decodes_to_the_tables_value_both_ways(device, name):
    """All 256 codes of a format through the kernels' decoding: by the hardware's conversion (sm_89 on)
    and by integer arithmetic (earlier GPUs' e4m3), each the reference table's value (the codes no
    cache holds, fp8's NaN and infinities, aside: values are clamped to the largest finite one)."""
    fmt = kv_format(name)
    rows = torch.zeros(16, 18, dtype=torch.uint8)
    rows[:, :16] = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16)
    expected = fmt.table()[rows[:, :16].long()]
    finite = expected.isfinite()
    constants = code_constants(fmt)
    ways = {constants["CODE"]} | ({2} if constants["CODE"] == 3 else set())
    assert ways == ({1} if name == "int8" else {2, 3})
    for code in ways:
        out = torch.empty(16, 16, device=device)
        _decode_every_code[(1,)](rows.to(device), out, code, constants["MANT"], constants["BIAS"])
        assert torch.equal(out.cpu()[finite], expected[finite]), code


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_store_kv_writes_the_references_quantized_rows(device, name):
    fmt = kv_format(name)
    k_cache = torch.zeros(6, 4, 2, 82, dtype=torch.uint8, device=device)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(5, 2, 80) * 4, torch.randn(5, 2, 80)
    slots = torch.tensor([3, -1, 23, 0, -1])
    store_kv(key.to(device), value.to(device), k_cache, v_cache, slots.to(device), kv_format=fmt)
    k_ref, v_ref = torch.zeros_like(k_cache).cpu(), torch.zeros_like(v_cache).cpu()
    ref.store_kv(key, value, k_ref, v_ref, slots, kv_format=fmt)
    assert torch.equal(k_cache.cpu(), k_ref) and torch.equal(v_cache.cpu(), v_ref)
    with pytest.raises(ValueError, match="kv_cache_dtype int8 cache's dtype must be one of"):
        store_kv(key, value, torch.zeros(6, 4, 2, 80), torch.zeros(6, 4, 2, 80), slots, kv_format=kv_format("int8"))


@pytest.mark.parametrize("device", DEVICES)
def test_copy_blocks_all_layers_in_one_launch(device):
    pool = torch.randn(6, 7, 4, 2, 16, device=device)  # 3 layers x (K, V), 7 blocks
    expected = pool.cpu().clone()
    pairs = torch.tensor([[0, 5], [2, 6], [2, 1]])
    ref.copy_blocks(expected, pairs)
    copy_blocks(pool, pairs)
    assert torch.equal(pool.cpu(), expected)


def test_launchers_reject_bad_arguments():
    case = make_case([5, 9], 16, 2, 64)
    q = torch.randn(2, 4, 64)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention_decode(torch.randn(2, 3, 64), case.k_cache, case.v_cache, case.block_tables, case.seq_lens, 1.0)
    with pytest.raises(ValueError, match="block_tables must be int32"):
        paged_attention_decode(q, case.k_cache, case.v_cache, case.block_tables.long(), case.seq_lens, 1.0)
    with pytest.raises(ValueError, match="power of two"):
        odd = make_case([5, 9], 7, 2, 64)
        paged_attention_decode(q, odd.k_cache, odd.v_cache, odd.block_tables, odd.seq_lens, 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(torch.randn(3, 2, 64), torch.randn(3, 2, 64), case.k_cache, case.v_cache, torch.tensor([1, 2]))


def test_expert_alignment_pads_each_run_to_whole_blocks():
    top_index = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 2]])  # expert 3 gets nothing
    pairs, experts = align_by_expert(top_index, 4, block_m=4)
    assert pairs.numel() == 8 + 4 * 3 and experts.tolist() == [0, 1, 2, 2, -1]
    assert pairs[:4].tolist() == [1, 4, 8, 8] and pairs[4:8].tolist() == [3, 8, 8, 8]
    assert pairs[8:16].tolist() == [0, 2, 5, 6, 7, 8, 8, 8] and set(pairs[16:].tolist()) == {8}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [(1, 4, 2, 32, 48), (37, 8, 2, 64, 32), (20, 3, 3, 48, 80)])
def test_fused_moe_matches_the_grouped_loop(device, dtype, tokens, experts, top_k, hidden, inter):
    """Widths that are not multiples of the tiles, an expert with no tokens, top-k = every expert."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, -1] = -1e9 if top_k < experts else logits[:, -1]  # the last expert unused unless every one is picked
    top_weight, top_index = logits.softmax(-1).topk(top_k, dim=-1)
    args = (x, gate_up, down, top_index, top_weight.to(dtype))
    expected = grouped_moe(*args)
    out = fused_moe(*(a.to(device) for a in args))
    close(out, expected, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model", ["llama-gqa", "mixtral"])  # mixtral: the fused MoE kernel in the model
def test_engine_on_the_triton_backend_matches_transformers(zoo, device, model):
    from pagedserve import LLM
    from pagedserve.shared.sampling import SamplingParams
    from tests.conftest import random_prompts

    cases = random_prompts(seed=7, count=4, max_len=40, vocab=512, max_new=6)
    llm = LLM(zoo.path(model), dtype="float32", device=device, attention_backend="triton", block_size=8,
              num_gpu_blocks=64, max_num_batched_tokens=24)  # chunked prefill over a cached prefix
    outs = llm.generate([p for p, _ in cases], [SamplingParams(temperature=0.0, max_tokens=n) for _, n in cases],
                        use_tqdm=False)
    for (prompt, n), out in zip(cases, outs):
        assert out.outputs[0].token_ids == zoo.hf_greedy(model, prompt, n)


@pytest.mark.parametrize("device", DEVICES)
def test_engine_on_the_triton_backend_reads_an_int8_cache_as_the_torch_reference_does(zoo, device):
    """The same bytes stored (one quantizer), the same rotation, attention read in registers: the
    Triton engine's greedy tokens are the reference engine's over chunked prefill and a cached prefix."""
    from pagedserve import LLM
    from pagedserve.shared.sampling import SamplingParams
    from tests.conftest import random_prompts

    cases = random_prompts(seed=11, count=4, max_len=40, vocab=512, max_new=6)
    prompts, params = [p for p, _ in cases], [SamplingParams(temperature=0.0, max_tokens=n) for _, n in cases]
    tokens = {}
    for backend, where in (("triton", device), ("torch", "cpu")):
        llm = LLM(zoo.path("llama-gqa"), dtype="float32", device=where, attention_backend=backend, block_size=8,
                  num_gpu_blocks=64, max_num_batched_tokens=24, kv_cache_dtype="int8")
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.parametrize("device", DEVICES)
def test_decode_graph_buffers_give_the_eager_logits(zoo, device):
    """What a CUDA graph replays (static buffers padded to a bucket, slot -1 rows, the decode grid
    launched for the context bucket) computes the eager step's logits. On the CPU this runs the graph's
    forward without capturing it; on CUDA the parity tests in tests/engine/test_gpu.py replay it."""
    from pagedserve import LLM
    from pagedserve.shared.sampling import SamplingParams
    from pagedserve.worker.runner.device.cuda_graphs import DecodeGraphs, GraphLimits

    llm = LLM(zoo.path("llama-gqa"), dtype="float32", device=device, attention_backend="triton", block_size=8,
              num_gpu_blocks=64, max_model_len=64, enforce_eager=True)
    engine = llm.engine
    for i, length in enumerate((3, 11, 17)):
        engine.add_request(str(i), list(range(20 + i, 20 + i + length)), SamplingParams(temperature=0.0, max_tokens=20))
    engine.step()  # the prompts; every step after this one is decode only
    plan = engine.scheduler.schedule()
    items = sorted(plan.seqs, key=lambda s: s.num_tokens > 1)
    assert len(items) == 3 and all(s.num_tokens == 1 for s in items)
    eager = engine.runner.forward(plan).logits
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.device, 8, GraphLimits(max_model_len=64, max_num_seqs=4))
    assert graphs.can_run(items) and graphs.sizes == [1, 2, 4]
    assert graphs.key(items) == (4, 1, 64)  # max_model_len caps the first context bucket
    bucket = graphs.bucket(*graphs.key(items))
    graphs._load(bucket, items, runner.tables)  # forward() took the plan's table changes
    with torch.inference_mode():
        replayed = graphs._forward(bucket, graphs._metadata(bucket))
    assert bucket.slots[3] == -1 and bucket.lens[3] == 1  # the padding row writes nothing
    close(replayed[:3], eager, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_graph_buffers_with_lora_adapters_give_the_eager_logits(zoo, tmp_path, device):
    """A decode step mixing two adapters and base rows through a graph's buffers: each adapter copied
    into a place of the fixed stack, each row naming its place (-1 for the base model and the
    padding), the same logits as the eager step; a third adapter takes the least recent place, and
    one read again under its name is copied anew."""
    from pagedserve import LLM
    from pagedserve.shared.sampling import SamplingParams
    from pagedserve.worker.runner.device.cuda_graphs import DecodeGraphs, GraphLimits
    from pagedserve.worker.runner.lora.adapters import stacked
    from pagedserve.worker.runner.lora.graph_stack import GraphStack, stack_bytes
    from pagedserve.worker.runner.loader import inspect_model
    from tests.runner.test_adapters_runtime import ATTENTION, target_shapes, write_adapter

    shapes = target_shapes(inspect_model(zoo.path("llama-gqa"), "float32").config)
    paths = {name: write_adapter(tmp_path / name, shapes, rank, targets, seed) for name, rank, targets, seed in [
        ("a", 4, ATTENTION, 1), ("b", 8, ("gate_proj", "up_proj", "down_proj", "q_proj"), 2), ("c", 2, ATTENTION, 3)]}
    llm = LLM(zoo.path("llama-gqa"), dtype="float32", device=device, attention_backend="triton", block_size=8,
              num_gpu_blocks=64, max_model_len=64, enforce_eager=True, enable_lora=True, max_loras=2, max_lora_rank=8)
    engine, runner = llm.engine, llm.engine.runner
    for name, path in paths.items():
        engine.load_adapter(name, str(path))
    stack = GraphStack(runner.adapters)
    assert stack_bytes(runner.adapters) == sum(a.numel() * 4 + b.numel() * 4 for a, b in stack.weights.values())
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.device, 8, GraphLimits(max_model_len=64, max_num_seqs=4),
                          stack)

    for i, (length, adapter) in enumerate(zip((3, 11, 17), ["a", None, "b"])):
        engine.add_request(str(i), list(range(20 + i, 20 + i + length)), SamplingParams(temperature=0.0, max_tokens=4),
                           adapter=adapter)
    engine.step()  # the prompts; the next step decodes only
    plan = engine.scheduler.schedule()
    items = sorted(plan.seqs, key=lambda s: s.num_tokens > 1)
    assert len(items) == 3 and all(s.num_tokens == 1 for s in items) and graphs.can_run(items)
    eager = runner.forward(plan).logits
    bucket = graphs.bucket(*graphs.key(items))
    graphs._load(bucket, items, runner.tables)
    with torch.inference_mode():
        replayed = graphs._forward(bucket, graphs._metadata(bucket))
    close(replayed[:3], eager, torch.float32)
    assert bucket.adapter_slots.tolist() == [{"a": 0, "b": 1, None: -1}[s.adapter] for s in items] + [-1]
    assert runner.adapters.step.weights == {} and runner.adapters.step.slots is None  # cleared after the forward

    class Row:
        def __init__(self, adapter):
            self.adapter, self.num_tokens = adapter, 1

    def held(place: int, name: str) -> bool:
        """Whether ``place`` holds adapter ``name``'s matrices (as the eager stack makes them), zeros past them."""
        adapters = runner.adapters
        own = stacked(adapters.loaded[name], adapters.layout, adapters.widths, adapters.device, adapters.dtype)
        for key, (a_all, b_all) in stack.weights.items():
            a, b = own.get(key, (a_all[place, :0], b_all[place, :, :0]))
            rank = a.shape[0]
            if not (torch.equal(a_all[place, :rank], a) and torch.equal(b_all[place, :, :rank], b)
                    and not a_all[place, rank:].any() and not b_all[place, :, rank:].any()):
                return False
        return True

    assert held(0, "a") and held(1, "b")
    slots = torch.zeros(4, dtype=torch.int32, device=device)
    stack.load([Row("c"), Row("b"), Row(None)], slots)  # "a" is the least recent: "c" takes its place
    assert slots.tolist() == [0, 1, -1, -1] and held(0, "c") and held(1, "b")
    runner.adapters.load("b", paths["a"])  # read again under its name: copied anew on its next use
    stack.load([Row("b")], slots)
    assert slots.tolist() == [1, -1, -1, -1] and held(1, "b") and held(0, "c")
    assert not graphs.can_run([Row(n) for n in "abc"])  # more adapters than places: the step runs eagerly


def uncaptured_graphs(runner, limits):
    """The runner's decode graphs' buffers and forward without capturing: a replay runs the forward
    the graph would hold (what a replay computes, on any device)."""
    from pagedserve.worker.runner.device.cuda_graphs import DecodeGraphs

    class Uncaptured(DecodeGraphs):
        def _capture(self, size: int, width: int, context: int):
            bucket, graphs = self.bucket(size, width, context), self

            class Replay:
                def replay(self) -> None:
                    bucket.logits = graphs._forward(bucket, graphs._metadata(bucket))

            self._buckets[(size, width, context)], bucket.graph = bucket, Replay()
            return bucket

    return Uncaptured(runner.model, runner.kv_caches, runner.device, runner.block_size, limits)  # a Drafter's too


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_checking_drafts_through_a_graphs_buffers_gives_the_eager_logits(zoo, device):
    """A speculative step (rows of 2, 1, 3 and no drafts) through a graph of rows of 4 token places:
    the logits of every sampled and drafted position are the eager step's. Padding writes nothing and
    reads no table entry a row does not own (the row ending its block reaches the next entry: zeroed,
    not the stale -1 an earlier sequence left)."""
    from pagedserve import LLM
    from pagedserve.shared.sampling import SamplingParams
    from pagedserve.worker.runner.device.cuda_graphs import GraphLimits

    llm = LLM(zoo.path("llama-gqa"), dtype="float32", device=device, attention_backend="triton", block_size=8,
              num_gpu_blocks=64, max_model_len=64, enforce_eager=True)
    engine, runner = llm.engine, llm.engine.runner
    drafts = {"0": 2, "1": 1, "2": 3, "3": 0}  # the prompt of 6 and its draft end block 0
    for (request, n), length in zip(drafts.items(), (3, 6, 11, 17)):
        engine.add_request(request, list(range(20, 20 + length)), SamplingParams(temperature=0.0, max_tokens=20))
    engine.step()  # the prompts
    plan = engine.scheduler.schedule()
    plan = dataclasses.replace(plan, seqs=tuple(
        dataclasses.replace(s, token_ids=s.token_ids + tuple(range(40, 40 + drafts[s.request_id])),
                            num_draft=drafts[s.request_id]) for s in plan.seqs))
    eager = runner.forward(plan)
    kept = runner.tables
    for s in plan.seqs:  # past every row's blocks: what a released window's entries look like
        kept._tables[:, kept._rows[s.seq_id], kept.length(s.seq_id) :] = -1
    runner.graphs = uncaptured_graphs(runner, GraphLimits(max_model_len=64, max_num_seqs=16, max_draft=3))
    assert runner.graphs.widths == (1, 2, 3, 4) and runner.graphs.key(list(plan.seqs)) == (4, 4, 64)
    replayed = runner.forward(plan)
    assert [s.seq_id for s in replayed.items] == [s.seq_id for s in eager.items]
    close(replayed.logits, eager.logits, torch.float32)
    assert eager.drafts.keys() == replayed.drafts.keys() and len(eager.drafts) == 3
    for seq_id, logits in eager.drafts.items():
        close(replayed.drafts[seq_id], logits, torch.float32)
    bucket = runner.graphs._buckets[(4, 4, 64)]
    row = [s.request_id for s in sorted(plan.seqs, key=lambda s: s.num_tokens > 1)].index("1")
    assert bucket.slots[row * 4 + 2 :].tolist()[:2] == [-1, -1] and bucket.lens[row] == 10
    assert bucket.tables[row, 1] == 0  # its padding's positions 8 and 9 read block 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_through_the_graphs_gives_the_eager_tokens(zoo, device, method):
    """Greedy generation with n-gram or draft-model drafts, every step the graphs can take replayed
    through their buffers (rows of 2 to 4 token places and plain decodes; the draft model's rounds
    through graphs of its own), gives the eager engine's tokens."""
    from pagedserve import LLM
    from pagedserve.shared.sampling import SamplingParams
    from pagedserve.worker.runner.device.cuda_graphs import GraphLimits

    prompts = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5 + [12], list(range(30, 43))]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    spec = {"method": method, "num_speculative_tokens": 3,
            **({"model": str(zoo.path("llama-gqa"))} if method == "draft_model" else {})}
    limits = GraphLimits(max_model_len=64, max_num_seqs=16, max_draft=3)
    tokens, widths, accepted = {}, set(), {}
    for graphs in (False, True):
        llm = LLM(zoo.path("llama-gqa"), dtype="float32", device=device, attention_backend="triton", block_size=8,
                  num_gpu_blocks=64, max_model_len=64, enforce_eager=True, speculative_config=spec)
        runner = llm.engine.runner
        if graphs:
            runner.graphs = uncaptured_graphs(runner, limits)
            if runner.drafter is not None:
                runner.drafter.graphs = uncaptured_graphs(runner.drafter, limits)
        tokens[graphs] = [o.outputs[0].token_ids for o in llm.generate(prompts, [params] * 3, use_tqdm=False)]
        widths = {width for _, width, _ in runner.graphs._buckets} if graphs else widths
        accepted[graphs] = llm.engine.stats()["spec_decode_num_accepted_tokens_total"]
    assert tokens[True] == tokens[False]
    assert accepted[True] == accepted[False] > 0  # the same drafts (a wrong one changes no token, only this)
    assert 1 in widths and widths - {1}  # decodes and rows of drafts both replayed
    if method == "draft_model":
        assert runner.drafter.graphs._buckets  # the draft model's rounds replayed too


@pytest.mark.parametrize("device", DEVICES)
def test_steps_running_ahead_through_the_graphs_give_the_tokens_of_one_step_at_a_time(zoo, device):
    """``--async-scheduling`` with every decode replayed through the graphs' buffers: each placeholder
    is filled in the graph's token buffer, at its row's place, from the previous step's tokens on the
    device; greedy and seeded tokens equal one step at a time without graphs."""
    from pagedserve import LLM
    from pagedserve.shared.sampling import SamplingParams
    from pagedserve.worker.runner.device.cuda_graphs import GraphLimits

    prompts = [list(range(30, 30 + n)) for n in (3, 9, 14, 5)]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=4, max_tokens=7, ignore_eos=True)] * 2
    tokens, replays = {}, []
    for ahead in (False, True):
        llm = LLM(zoo.path("llama-gqa"), dtype="float32", device=device, attention_backend="triton", block_size=8,
                  num_gpu_blocks=64, max_model_len=64, enforce_eager=True, async_scheduling=ahead)
        runner = llm.engine.runner
        if ahead:
            runner.graphs = uncaptured_graphs(runner, GraphLimits(max_model_len=64, max_num_seqs=8))
            real = runner.graphs.run
            runner.graphs.run = lambda items, tables, holes=None: (replays.append(holes), real(items, tables, holes))[1]
        tokens[ahead] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens[True] == tokens[False]
    assert sum(holes is not None for holes in replays) > 5  # decodes replayed with their tokens filled on the device


@pytest.mark.parametrize("device", DEVICES)
def test_hybrid_lanes_through_the_triton_kernels_and_the_graphs_equal_transformers(zoo, device):
    """Gemma 3's lanes of layers (five sliding layers of window 8 for each full one; a sliding lane's
    blocks past its window released, their entries -1) on the Triton kernels, every decode step
    replayed through the graphs' buffers (a slots buffer and a table per lane): transformers' greedy
    tokens, far past the window."""
    from pagedserve import LLM
    from pagedserve.shared.sampling import SamplingParams
    from pagedserve.worker.runner.device.cuda_graphs import GraphLimits
    from tests.conftest import random_prompts

    cases = random_prompts(seed=61, count=2, max_len=30, vocab=512, max_new=24)
    llm = LLM(zoo.path("gemma3"), dtype="float32", device=device, attention_backend="triton", block_size=4,
              num_gpu_blocks=128, max_model_len=128, max_num_batched_tokens=32, enforce_eager=True)
    runner = llm.engine.runner
    assert runner.model.kv_layout.num_lanes > 1
    runner.graphs = uncaptured_graphs(runner, GraphLimits(max_model_len=128, max_num_seqs=4))
    done = llm.generate([p for p, _ in cases], [SamplingParams(temperature=0.0, max_tokens=n) for _, n in cases],
                        use_tqdm=False)
    for (prompt, n), out in zip(cases, done):
        assert out.outputs[0].token_ids == zoo.hf_greedy("gemma3", prompt, n)
    assert runner.graphs._buckets  # the decode steps went through the graphs' buffers


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_pool_past_2_31_elements_is_read_and_written_at_its_highest_blocks():
    """A real GPU's pool holds more than 2**31 elements: sequences on its last blocks give what the
    same kernels give on a small pool holding the same rows (int32 offsets would wrap)."""
    block_size, kv_heads, head_dim, dtype = 16, 8, 128, torch.bfloat16
    lengths = [40, 600, 17]
    small = make_case(lengths, block_size, kv_heads, head_dim, dtype, "cuda")
    used = small.k_cache.shape[0]
    num_blocks = 2**31 // (block_size * kv_heads * head_dim) + used
    base = num_blocks - used
    k_big = torch.zeros((num_blocks, block_size, kv_heads, head_dim), dtype=dtype, device="cuda")
    v_big = torch.zeros_like(k_big)
    assert k_big.numel() > 2**31
    k_big[base:], v_big[base:] = small.k_cache, small.v_cache
    tables = small.block_tables + base
    q = torch.randn(len(lengths), 32, head_dim, device="cuda").to(dtype)
    assert torch.equal(paged_attention_decode(q, k_big, v_big, tables, small.seq_lens, 0.1),
                       paged_attention_decode(q, small.k_cache, small.v_cache, small.block_tables, small.seq_lens, 0.1))
    q_lens = [8, 1, 17]
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    qp = torch.randn(sum(q_lens), 32, head_dim, device="cuda").to(dtype)
    assert torch.equal(prefill_attention(qp, k_big, v_big, tables, starts, small.seq_lens, 0.125),
                       prefill_attention(qp, small.k_cache, small.v_cache, small.block_tables, starts, small.seq_lens, 0.125))
    key = torch.randn(block_size, kv_heads, head_dim, device="cuda").to(dtype)
    slots = torch.arange((num_blocks - 1) * block_size, num_blocks * block_size, device="cuda")
    store_kv(key, -key, k_big, v_big, slots)
    assert torch.equal(k_big[-1], key) and torch.equal(v_big[-1], -key)
    assert torch.equal(k_big[0], torch.zeros_like(key))
