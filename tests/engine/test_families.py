"""Families beyond the Llama ones: greedy output equals transformers token for token for Phi-3
(fused weights, partial rotary) and mixture-of-experts models (Mixtral; Qwen2-MoE with its shared expert; Qwen3-MoE with a dense layer
among sparse ones), concurrent requests of different lengths, under preemption, with prefix-cache
hits and with n > 1. Random routers: every token goes through its own top-2 of 4 experts."""

from __future__ import annotations

import json

import pytest

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.runner.loader import UnsupportedModelError
from pagedserve.worker.runner.models.families import FAMILIES
from pagedserve.worker.runner.models.moe import SparseMoE
from pagedserve.worker.source.model_types import CAUSAL_LM
from tests.conftest import random_prompts
from tests.engine.test_parity import VOCAB, assert_parity

MOE = ["mixtral", "qwen2-moe", "qwen3-moe", "olmoe"]


@pytest.mark.parametrize("name", MOE)
def test_moe_greedy_parity_concurrent_requests(zoo, name):
    cases = random_prompts(seed=21, count=16, max_len=300, vocab=VOCAB, max_new=120)
    llm = assert_parity(zoo, name, cases, block_size=16, num_gpu_blocks=2048)
    layers = llm.engine.runner.model.model.layers
    kinds = ["moe" if isinstance(layer.mlp, SparseMoE) else "dense" for layer in layers]
    assert kinds == (["moe", "dense", "moe"] if name == "qwen3-moe" else ["moe", "moe"])  # qwen3-moe: mlp_only_layers=[1]


def test_phi3_fused_weights_and_partial_rotary_parity(zoo):
    """Phi-3's fused q/k/v and gate/up tensors split on load; half of each head rotates (as Phi-4-mini)."""
    cases = random_prompts(seed=24, count=16, max_len=300, vocab=VOCAB, max_new=120)
    llm = assert_parity(zoo, "phi3", cases, block_size=16, num_gpu_blocks=2048)
    assert llm.engine.runner.model.rotary.by_type["default"].inv_freq.numel() * 2 == llm.engine.runner.model.head_dim // 2


@pytest.mark.parametrize("name, windows", [("mistral-window", [24, 24]), ("qwen2-window", [0, 20, 20])])
def test_sliding_window_parity_past_the_window(zoo, name, windows):
    """Contexts many times the window, decode and chunked prefill: each windowed layer sees its last
    W positions (Qwen2: the first ``max_window_layers`` layers attend fully)."""
    cases = random_prompts(seed=25, count=12, max_len=150, vocab=VOCAB, max_new=80)
    llm = assert_parity(zoo, name, cases, block_size=8, num_gpu_blocks=2048, max_num_batched_tokens=64)
    attention = [layer.self_attn.attn.extra.get("window", 0) for layer in llm.engine.runner.model.model.layers]
    assert attention == windows


def test_gemma2_parity_with_soft_caps_sandwich_norms_and_alternating_windows(zoo):
    cases = random_prompts(seed=26, count=12, max_len=120, vocab=VOCAB, max_new=60)
    llm = assert_parity(zoo, "gemma2", cases, block_size=8, num_gpu_blocks=2048, max_num_batched_tokens=64)
    extras = [layer.self_attn.attn.extra for layer in llm.engine.runner.model.model.layers]
    assert extras == [{"window": 8, "softcap": 2.0}, {"softcap": 2.0}] * 2


def test_gemma3_parity_with_per_head_qk_norms_and_local_global_rope(zoo):
    """Gemma 3 (text): q/k normed per head, local layers (window 8) rotating with base 10,000 and
    global ones with their own base; the pattern is 5 local to 1 global, here over 6 layers."""
    cases = random_prompts(seed=28, count=12, max_len=120, vocab=VOCAB, max_new=60)
    llm = assert_parity(zoo, "gemma3", cases, block_size=8, num_gpu_blocks=2048, max_num_batched_tokens=64)
    model = llm.engine.runner.model
    assert sorted(model.rotary.by_type) == ["full_attention", "sliding_attention"]
    assert [layer.self_attn.attn.extra.get("window", 0) for layer in model.model.layers] == [8] * 5 + [0]


def test_moe_parity_under_preemption_and_prefix_hits(zoo):
    system = [11 + (i * 7) % 400 for i in range(64)]
    cases = [(system + p, n) for p, n in random_prompts(seed=22, count=16, max_len=60, vocab=VOCAB, max_new=60)]
    llm = assert_parity(zoo, "mixtral", cases, block_size=8, num_gpu_blocks=90, num_cpu_blocks=400,
                        preemption_mode="recompute", max_num_batched_tokens=256)
    stats = llm.engine.scheduler.stats
    assert stats.num_preemptions > 0 and stats.prefix_hit_tokens > 0, stats


def test_moe_forks_of_a_greedy_n_request_all_match(zoo):
    prompt, n = random_prompts(seed=23, count=1, max_len=80, vocab=VOCAB, max_new=40)[0]
    llm = LLM(zoo.path("qwen2-moe"), device="cpu", dtype="float32", num_gpu_blocks=512)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, n=3), use_tqdm=False)[0]
    want = zoo.hf_greedy("qwen2-moe", prompt, n)
    assert [o.token_ids for o in out.outputs] == [want] * 3


def test_an_unknown_family_names_the_supported_ones(tmp_path, zoo):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((zoo.path("llama-gqa") / name).read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*mixtral \(MixtralForCausalLM\).*qwen3_moe"):
        LLM(tmp_path)


def test_every_family_built_is_a_model_type_named_and_back():
    """The runner builds exactly the model types whose classes worker/source/model_types.py names."""
    assert list(FAMILIES) == list(CAUSAL_LM)


@pytest.mark.parametrize("name", ["llama-linear", "qwen2-yarn"])
def test_scaled_rope_parity(zoo, name):
    """Linear and YaRN scaling (YaRN's attention factor on cos/sin too), weights large enough that
    positions move the logits."""
    cases = random_prompts(seed=31, count=8, max_len=120, vocab=VOCAB, max_new=40)
    llm = assert_parity(zoo, name, cases, block_size=8, num_gpu_blocks=2048)
    assert llm.engine.runner.model.rotary.by_type["default"].rope_type == name.split("-")[1]


@pytest.mark.parametrize("name, changes_at", [("llama-dynamic", 48), ("phi3-longrope", 48)])
def test_length_dependent_rope_parity_across_the_switch(zoo, name, changes_at):
    """Dynamic NTK (Llama, past max_position_embeddings = 48 the base grows with the length) and
    long-rope (Phi-3, past original_max_position_embeddings = 48 the long factors): prompts that
    end before and after the switch, sequences that cross it while decoding, all in one batch,
    each token rotated for its own sequence's length."""
    cases = random_prompts(seed=29, count=12, max_len=90, vocab=VOCAB, max_new=50)
    assert any(len(p) < changes_at < len(p) + n for p, n in cases) and any(len(p) > changes_at for p, _ in cases)
    llm = assert_parity(zoo, name, cases, block_size=8, num_gpu_blocks=2048, max_num_batched_tokens=32)
    assert llm.engine.runner.model.rotary.needs_seq_lens  # and prompts past 32 tokens were prefilled in chunks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_long_rope_recomputes_a_sequence_growing_past_the_switch(zoo, mode):
    """transformers recomputes a Phi-3 sequence's cache with the long factors when it grows past
    original_max_position_embeddings; so does the scheduler. A 40-token system prompt shared by
    prompts that end before the switch and after it: its cached blocks serve only sequences
    rotated like them (short or long), under preemption too."""
    system = [11 + (i * 7) % 400 for i in range(40)]
    cases = [(system + p, n) for p, n in random_prompts(seed=30, count=14, max_len=30, vocab=VOCAB, max_new=40)]
    llm = assert_parity(zoo, "phi3-longrope", cases, block_size=8, num_gpu_blocks=24, num_cpu_blocks=400,
                        preemption_mode=mode, max_num_batched_tokens=64)
    stats = llm.engine.scheduler.stats
    assert stats.rope_recomputes > 0 and stats.prefix_hit_tokens > 0 and stats.num_preemptions > 0, stats


def test_dynamic_rope_serves_past_the_trained_length_by_its_factor():
    from transformers import LlamaConfig, Phi3Config

    from pagedserve.worker.source.resolve import max_model_len

    dynamic = LlamaConfig(max_position_embeddings=4096, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert max_model_len(dynamic) == 8192
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    config = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=131072,
                        original_max_position_embeddings=4096, rope_scaling=longrope)
    assert max_model_len(config) == 131072


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_sliding_window_model_holds_only_the_blocks_its_window_needs(zoo, mode):
    """Mistral, window 24, blocks of 8: as sequences grow to 260 tokens, each holds at most
    ceil(24 / 8) + 1 blocks after every step (released blocks go back to the pool, or to the prefix
    cache), and the output still equals transformers, under preemption too."""
    cases = random_prompts(seed=27, count=10, max_len=60, vocab=VOCAB, max_new=200)
    llm = LLM(zoo.path("mistral-window"), device="cpu", dtype="float32", block_size=8, num_gpu_blocks=30,
              num_cpu_blocks=400, preemption_mode=mode, max_num_batched_tokens=64)
    engine, blocks = llm.engine, llm.engine.scheduler.blocks
    assert engine.scheduler.config.sliding_window == 24
    for i, (prompt, n) in enumerate(cases):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=n))
    done, most = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
        blocks.check_invariants()
        for seq in engine.scheduler.table._seqs.values():
            if blocks.has_seq(seq.seq_id) and not blocks.is_swapped(seq.seq_id):
                held = [b for b in blocks.block_table(seq.seq_id) if b >= 0]
                chunk_room = -(-64 // 8)  # a prefill chunk's blocks, until the step that computed them ends
                assert len(held) <= 24 // 8 + 1 + chunk_room
                if seq.num_computed + 1 == seq.num_tokens:  # between decode steps: the window and one partial block
                    assert len(held) <= 24 // 8 + 1, (seq.num_tokens, blocks.block_table(seq.seq_id))
                most = max(most, len(held))
    assert most >= 3 and engine.scheduler.stats.num_preemptions > 0  # 30 blocks; 10 x 260 tokens would need 330
    for i, (prompt, n) in enumerate(cases):
        assert done[i].outputs[0].token_ids == zoo.hf_greedy("mistral-window", prompt, n), f"request {i}"
