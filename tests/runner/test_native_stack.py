"""A decode step's decoder stack as direct C calls (``worker/runner/cpu/native_stack.py``): the same bits
as the module path it replaces (the same kernels and matrices, in the same order), with int8
matrices on the C kernel and any other form (prepacked float32, int4, bf16) through its module;
taken only where every layer's small operations are the kernels' and the step's rows are decodes or a
few tokens each (a draft checked: each token then gets the bits of a decode step of its own), and the
real model's greedy text unchanged by it."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.runner.cpu.native_stack import SHORT_ROW, NativeStack
from tests.engine.test_speculative import prompts as drafting_prompts


def _decode_steps(llm: LLM, prompts: list[list[int]], tokens: int = 3) -> list[tuple]:
    """The model's inputs of every step of ``prompts`` generated together."""
    model, seen = llm.engine.runner.model, []
    forward = model.forward

    def capture(ids, positions, meta, kv_caches):
        seen.append((ids, positions, meta, kv_caches))
        return forward(ids, positions, meta, kv_caches)

    model.forward = capture
    try:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    finally:
        model.forward = forward
    return seen


def _both_paths(model, step) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's final hidden states through the stack, then through the modules (each writes the
    same K/V into the same slots)."""
    stack = model.native_stack
    with torch.inference_mode():
        stacked = model(*step)
        model.native_stack = None
        try:
            modules = model(*step)
        finally:
            model.native_stack = stack
    return stacked, modules


@pytest.mark.parametrize("name, quantization", [("llama-gqa", "int8"), ("llama-mha", "int8"), ("qwen2", "int8"),
                                                ("qwen2", "none"), ("llama-gqa", "int4")])  # qwen2: q/k/v biases
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decode_step_through_the_stack_has_the_module_paths_bits(zoo, name, quantization, dtype):
    llm = LLM(zoo.path(name), device="cpu", dtype=dtype, quantization=quantization, block_size=8, num_gpu_blocks=64)
    model = llm.engine.runner.model
    assert isinstance(model.native_stack, NativeStack)
    steps = _decode_steps(llm, [[5, 6, 7], list(range(20, 45)), [9]])
    decodes = [s for s in steps if s[2].num_decodes == s[0].shape[0]]
    assert len(decodes) == 2 and decodes[0][0].shape[0] == 3  # three sequences a step
    for step in decodes:
        stacked, modules = _both_paths(model, step)
        assert torch.equal(stacked, modules)
    one = _decode_steps(llm, [[11, 12]], tokens=2)[-1]
    assert one[0].shape[0] == 1
    assert torch.equal(*_both_paths(model, one))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_gguf_run_as_stored_goes_through_the_stack_with_the_module_paths_bits(zoo, tmp_path, dtype):
    """A Q8_0 GGUF's blocks as stored (the default for a quantized GGUF): the stack calls the kernel per
    part of each fused layer, with q/k/v biases (qwen2), as ``GgufLinear`` does."""
    from pagedserve.worker.runner.cpu.gguf_linear import GgufLinear
    from tests.gguf_writer import write_gguf

    gguf = write_gguf(zoo.path("qwen2-256"), tmp_path / "q8.gguf", quantize="Q8_0")
    llm = LLM(gguf, device="cpu", dtype=dtype, block_size=8, num_gpu_blocks=64)
    model = llm.engine.runner.model
    assert isinstance(model.native_stack, NativeStack) and isinstance(model.model.layers[0].self_attn.qkv_proj, GgufLinear)
    for layer in model.model.layers:  # the checkpoint's biases are zeros: give each part's columns their own
        layer.self_attn.qkv_proj.bias.normal_()
    decodes = [s for s in _decode_steps(llm, [[5, 6, 7], list(range(20, 45)), [9]]) if s[2].num_decodes == s[0].shape[0]]
    for step in decodes:
        assert torch.equal(*_both_paths(model, step))
    # From the layers' GEMM size on (this CPU's), a step is the modules': each matrix decoded once for all rows
    import sys

    from pagedserve.worker.runner.cpu.gguf_linear import gemm_rows_here

    stack = model.native_stack
    assert stack.gemm_rows == gemm_rows_here(kernels=model.model.layers[0].self_attn.qkv_proj.kernels).get(
        getattr(torch, dtype), sys.maxsize)
    ids, positions, meta, kv_caches = decodes[-1]
    stack.gemm_rows = ids.shape[0]
    assert not stack.takes(model.embed(ids), model.rotary(positions, getattr(torch, dtype)), meta, kv_caches)
    stack.gemm_rows += 1
    assert stack.takes(model.embed(ids), model.rotary(positions, getattr(torch, dtype)), meta, kv_caches)


def test_a_step_with_a_long_prefill_chunk_takes_the_module_path_and_short_rows_the_stack(zoo):
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", quantization="int8", block_size=8,
              num_gpu_blocks=64)
    model = llm.engine.runner.model
    for prompt, taken in ((list(range(5, 5 + SHORT_ROW + 1)), False), (list(range(5, 5 + SHORT_ROW)), True)):
        ids, positions, meta, kv_caches = _decode_steps(llm, [prompt], tokens=1)[0]
        tables = model.rotary(positions, torch.float32)
        assert model.native_stack.takes(model.embed(ids), tables, meta, kv_caches) is taken


@pytest.mark.parametrize("dtype, quantization", [("float32", "none"), ("float32", "int8"), ("bfloat16", "none")])
def test_checked_drafts_get_the_bits_of_one_decode_step_a_token(zoo, dtype, quantization):
    """Rows of a few tokens (speculative decoding's drafts, checked in one forward) run through the
    stack, each token as a decode of its own: greedy tokens and logprobs with prompt lookup are, to the
    bit, the engine's without it, with drafts kept, rows decoding beside them and rows that draft
    more than one block's worth."""
    batch = drafting_prompts(6)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)

    def run(speculative):
        llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype=dtype, quantization=quantization, block_size=4,
                  num_gpu_blocks=256, seed=0, speculative_config=speculative)
        llm.engine.scheduler.step_cost = None  # draft whatever a step costs
        stack, short = llm.engine.runner.model.native_stack, []
        takes = stack.takes

        def spy(x, tables, meta, kv_caches):
            taken = takes(x, tables, meta, kv_caches)
            short.append(taken and meta.num_decodes < x.shape[0])
            return taken

        stack.takes = spy
        outs = llm.generate(batch, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], sum(short), llm

    plain, _, _ = run(None)
    drafted, short_steps, llm = run({"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 3})
    assert short_steps > 0 and llm.engine.scheduler.applier.spec_stats.accepted_tokens > 0
    assert drafted == plain


@pytest.mark.parametrize("options", [dict(quantization="int8", kv_cache_dtype="int8"),
                                     dict(quantization="int8", attention_backend="torch")])
def test_models_whose_layers_are_not_entirely_the_kernels_have_no_stack(zoo, options):
    """A quantized cache (keys turned between the rotary and the store), the torch backend (no C
    kernels), a family whose layers differ (Gemma 2): the modules run every step."""
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", block_size=8, num_gpu_blocks=64, **options)
    assert llm.engine.runner.model.native_stack is None
    gemma = LLM(zoo.path("gemma2"), device="cpu", dtype="float32", block_size=8, num_gpu_blocks=64)
    assert gemma.engine.runner.model.native_stack is None


@pytest.mark.parametrize("quantization", ["int8", "none"])
def test_the_real_models_greedy_text_and_logprobs_are_the_module_paths(real_model, quantization):
    """SmolLM2 with int8 weights (the C kernel) and float32 ones (oneDNN's, through their modules),
    three requests together and one alone, through the stack and with it removed: the same tokens
    and the same logprobs to the bit."""
    llm = LLM(real_model.gguf, dtype="float32", quantization=quantization)
    model = llm.engine.runner.model
    assert isinstance(model.native_stack, NativeStack)
    prompts = [real_model.chat_ids(text) for text in ("Name three rivers.", "What is 7 times 8?", "Say hello.")]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1)

    def run():
        llm.engine.forget_cached()
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.engine.forget_cached()  # a prefix hit's short tail would run as decodes: the stack's, not the modules' bits
        outs += llm.generate(prompts[:1], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [lp for lp in o.outputs[0].logprobs]) for o in outs]

    stacked = run()
    stack, model.native_stack = model.native_stack, None
    try:
        modules = run()
    finally:
        model.native_stack = stack
    assert [tokens for tokens, _ in stacked] == [tokens for tokens, _ in modules]
    assert stacked == modules
