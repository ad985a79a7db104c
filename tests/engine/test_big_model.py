"""The model users run (Qwen2.5-Coder-1.5B-Instruct, a Q4_K_M GGUF from its chunk wheels; the
``big_model`` fixture): its Q4_K and Q6_K blocks executed as stored, held to transformers' reading of
the same file (every block dequantized to float32): greedy output token for token, and perplexity on
real prose within 0.1% at float32 (0.5% at bf16) on the row-by-row kernel and on the decoded GEMM
a prefill takes."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve import LLM
from pagedserve.bench.kv_quality import text
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.offline_outputs import prompt_token_logprobs
from pagedserve.worker.runner.cpu.gguf_linear import GgufEmbedding, GgufLinear
from pagedserve.worker.runner.cpu.prepack import bf16_in_hardware

pytestmark = pytest.mark.slow
PROSE_TOKENS = 384


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def test_every_matrix_runs_as_stored_by_default_and_greedy_output_equals_transformers(big_model):
    llm = LLM(big_model.gguf, dtype="float32", num_gpu_blocks=64, max_model_len=1024)
    model = llm.engine.runner.model
    stored = [m for m in model.modules() if isinstance(m, GgufLinear)]
    # per layer q/k/v fused, o, gate/up fused and down (4 modules, 7 matrices), and the head
    assert len(stored) == 4 * 28 + 1 and sum(len(m.parts) for m in stored) == 7 * 28 + 1
    assert isinstance(model.model.embed_tokens, GgufEmbedding)
    assert {m.extra_repr().rsplit("=", 1)[1] for m in stored} >= {"Q4_K", "Q6_K", "Q4_K+Q4_K+Q6_K"}
    params = SamplingParams(temperature=0, max_tokens=24)
    for question in ("Write a Python function that returns the n-th Fibonacci number.", "What is 2+2?"):
        prompt = big_model.chat_ids(question)
        ours = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert list(ours) == big_model.hf_greedy(prompt, 24)[:len(ours)], question


def test_the_default_dtype_of_a_quantized_gguf_is_bf16_where_the_cpu_multiplies_it(big_model):
    from pagedserve.worker.runner.loader import inspect_model

    assert inspect_model(big_model.gguf).dtype == (torch.bfloat16 if bf16_in_hardware() else torch.float32)
    assert inspect_model(big_model.gguf, "float32").dtype == torch.float32


def prose_logprobs(big_model, **engine) -> list[float]:
    ids = big_model.tokenizer.encode(text(), add_special_tokens=False)[:PROSE_TOKENS]
    llm = LLM(big_model.gguf, num_gpu_blocks=64, max_model_len=1024, **engine)
    return prompt_token_logprobs(llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                                              use_tqdm=False)[0])


@pytest.mark.parametrize("dtype, chunk, bound", [("float32", 16, 1e-3), ("float32", 512, 1e-3),
                                                 ("bfloat16", 16, 5e-3), ("bfloat16", 512, 5e-3)])
def test_perplexity_as_stored_is_transformers_dequantized_reading(big_model, dtype, chunk, bound):
    """16-token chunks take the int16 row kernel, 512-token ones the decoded GEMM. Measured against
    transformers' float32 reading (bench/gguf_quality.py and this text): float32 0.000% either way; bf16,
    whose activations' rounding moves perplexity more than the weights' form does, +0.07% / +0.20% on
    these 383 tokens and +0.25% / +0.002% on 1,023 (the dequantized weights at bf16: -0.12% / +0.05%)."""
    if dtype == "bfloat16" and not bf16_in_hardware():
        pytest.skip("no bf16 instructions here: a GGUF runs at float32 by default, bf16 only emulated (2.4 min a case)")
    ids = big_model.tokenizer.encode(text(), add_special_tokens=False)[:PROSE_TOKENS]
    reference = big_model.hf_logprobs(ids[:1], ids[1:])
    llm = LLM(big_model.gguf, dtype=dtype, max_num_batched_tokens=chunk, num_gpu_blocks=64, max_model_len=1024)
    ours = prompt_token_logprobs(llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                                              use_tqdm=False)[0])
    assert abs(perplexity(ours) / perplexity(reference) - 1) <= bound


def test_int8_activations_stay_within_two_percent_of_transformers_perplexity(big_model):
    """``--gguf-activations int8`` (llama.cpp's reading of the input, csrc/gguf_x8.c) through the row
    kernel: measured +0.70% (float32) and +1.05% (bf16) on 1,023 tokens (bench/gguf_quality.py), where
    the int16 kernel gives +0.00% / +0.05%; held here within 2%, and not within the int16 bound."""
    from pagedserve.kernels.native_layer_ops import GGUF_X8_TYPES

    ids = big_model.tokenizer.encode(text(), add_special_tokens=False)[:PROSE_TOKENS]
    llm = LLM(big_model.gguf, dtype="float32", max_num_batched_tokens=16, num_gpu_blocks=64, max_model_len=1024,
              gguf_activations="int8")
    if not llm.engine.runner.model.model.layers[0].mlp.down_proj.kernels.gguf_x8_runs(GGUF_X8_TYPES[0]):
        pytest.skip("no AVX-512 VNNI here: int8 activations take the int16 kernel")
    ours = prompt_token_logprobs(llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                                              use_tqdm=False)[0])
    change = abs(perplexity(ours) / perplexity(big_model.hf_logprobs(ids[:1], ids[1:])) - 1)
    assert 1e-3 < change <= 2e-2
