"""Multi-LoRA (worker/runner/lora/): each adapter's greedy output equals transformers + PEFT with that
adapter merged, with adapters and the base model mixed in one batch under preemption and forks;
the prefix cache never shares a block between adapters; a bad adapter is a clear error."""

from __future__ import annotations

import json

import pytest

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.shared.errors import InvalidRequestError
from pagedserve.worker.runner.lora.peft_adapter import LoraError
from tests.lora_helpers import ALL_TARGETS, greedy, make_adapter

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

@pytest.fixture(scope="module")
def adapters(zoo, tmp_path_factory):
    """Three adapters of llama-gqa (rank 8 on every target, rank 16 on some, rank 8 on the
    feed-forward only) and each one's merged reference."""
    root = tmp_path_factory.mktemp("adapters")
    specs = {"all8": (8, ALL_TARGETS), "some16": (16, ["q_proj", "v_proj", "down_proj"]), "mlp8": (8, ["gate_proj", "up_proj", "down_proj"])}
    return {name: (root / name, make_adapter(zoo, "llama-gqa", root / name, rank, targets, seed=i))
            for i, (name, (rank, targets)) in enumerate(specs.items())}


def test_each_adapter_matches_peft_merged_mixed_in_one_batch_under_preemption_and_forks(zoo, adapters):
    prompts = [[10 + i, 20 + 3 * i, 7, 300 + i] * (3 + i % 4) for i in range(12)]
    names = [None, "all8", "some16", "mlp8"] * 3
    # 10 blocks of 16 tokens for 12 sequences of up to 36: preempted and recomputed as they grow
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=10, enable_lora=True, max_loras=2)
    requests = [None if n is None else LoRARequest(n, 1, str(adapters[n][0])) for n in names]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2 if i == 5 else 1) for i in range(12)]
    outs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
    assert llm.engine.stats()["num_preemptions_total"] > 0
    for prompt, name, out in zip(prompts, names, outs):
        want = zoo.hf_greedy("llama-gqa", prompt, 12) if name is None else greedy(adapters[name][1], prompt, 12)
        assert [list(o.token_ids) for o in out.outputs] == [want] * len(out.outputs), name
    # the adapters do change the output (else the comparison above proves nothing)
    assert len({tuple(greedy(adapters[n][1], prompts[0], 12)) for n in adapters} | {tuple(zoo.hf_greedy("llama-gqa", prompts[0], 12))}) == 4


def test_the_same_prompt_under_two_adapters_shares_no_block(zoo, adapters):
    """A prompt of four full blocks under one adapter, then under another: the second must not reuse
    the first's KV (its output would be computed over the wrong adapter's keys and values), while
    the same adapter again does."""
    prompt = [11 + (7 * i) % 400 for i in range(64)]
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=64, enable_lora=True)
    path = {n: str(adapters[n][0]) for n in adapters}
    first = llm.generate([prompt], GREEDY, lora_request=LoRARequest("all8", 1, path["all8"]), use_tqdm=False)
    hits = llm.engine.stats()["prefix_cache_hits_total"]
    other = llm.generate([prompt], GREEDY, lora_request=LoRARequest("some16", 2, path["some16"]), use_tqdm=False)
    assert llm.engine.stats()["prefix_cache_hits_total"] == hits  # nothing shared across adapters
    base = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.engine.stats()["prefix_cache_hits_total"] == hits  # nor with the base model
    again = llm.generate([prompt], GREEDY, lora_request=LoRARequest("all8", 1, path["all8"]), use_tqdm=False)
    assert llm.engine.stats()["prefix_cache_hits_total"] > hits  # the same adapter does share
    assert first[0].outputs[0].token_ids == again[0].outputs[0].token_ids == greedy(adapters["all8"][1], prompt, 12)
    assert other[0].outputs[0].token_ids == greedy(adapters["some16"][1], prompt, 12)
    assert base[0].outputs[0].token_ids == zoo.hf_greedy("llama-gqa", prompt, 12)


def test_an_adapter_read_again_under_its_name_gets_new_blocks(zoo, adapters, tmp_path):
    """Blocks are salted with the adapter's bytes, not its name alone: an adapter replaced under the
    same name never reads the blocks its predecessor computed."""
    prompt = [13 + (5 * i) % 400 for i in range(48)]
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=64, enable_lora=True)
    llm.engine.load_adapter("x", str(adapters["all8"][0]))
    llm.generate([prompt], GREEDY, lora_request=LoRARequest("x", 1, ""), use_tqdm=False)
    hits = llm.engine.stats()["prefix_cache_hits_total"]
    llm.engine.load_adapter("x", str(adapters["mlp8"][0]))
    out = llm.generate([prompt], GREEDY, lora_request=LoRARequest("x", 1, ""), use_tqdm=False)
    assert llm.engine.stats()["prefix_cache_hits_total"] == hits
    assert out[0].outputs[0].token_ids == greedy(adapters["mlp8"][1], prompt, 12)


def test_bad_adapters_are_clear_errors(zoo, adapters, tmp_path):
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=16, enable_lora=True, max_lora_rank=8)
    load = llm.engine.load_adapter
    with pytest.raises(LoraError, match="not a directory"):
        load("a", str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoraError, match="no adapter_config.json"):
        load("a", str(tmp_path / "empty"))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    with pytest.raises(LoraError, match="no adapter_model.safetensors"):
        load("a", str(no_weights))
    with pytest.raises(LoraError, match="rank 16 is above --max-lora-rank 8"):
        load("a", str(adapters["some16"][0]))
    make_adapter(zoo, "llama-mha", tmp_path / "mha", 8, ["k_proj"], seed=5)  # four KV heads: k_proj is twice as wide
    with pytest.raises(LoraError, match=r"k_proj takes 64 inputs to 32 outputs \(is it this model's adapter"):
        load("a", str(tmp_path / "mha"))
    make_adapter(zoo, "llama-gqa", tmp_path / "dora", 8, ["q_proj"], seed=6, use_dora=True)
    with pytest.raises(LoraError, match="DoRA"):
        load("a", str(tmp_path / "dora"))
    with pytest.raises(InvalidRequestError, match="no adapter named 'ghost'"):
        llm.engine.add_request("r", [1, 2, 3], GREEDY, adapter="ghost")
    assert not llm.engine.adapters.loaded  # nothing half-loaded


def test_adapters_need_enable_lora_and_unload_waits_for_their_requests(zoo, adapters):
    plain = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=16)
    with pytest.raises(InvalidRequestError, match="--enable-lora"):
        plain.engine.add_request("r", [1, 2, 3], GREEDY, adapter="all8")
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=16, enable_lora=True,
              lora_modules=[f"all8={adapters['all8'][0]}"])
    llm.engine.add_request("r", [1, 2, 3], GREEDY, adapter="all8")
    with pytest.raises(LoraError, match="in use by 1 request.*unload it when"):
        llm.engine.unload_adapter("all8")
    with pytest.raises(LoraError, match="in use by 1 request.*replace it when"):
        llm.engine.load_adapter("all8", str(adapters["mlp8"][0]))
    while llm.engine.has_unfinished():
        llm.engine.step()
    llm.engine.unload_adapter("all8")
    with pytest.raises(InvalidRequestError, match="no adapter named 'all8'"):
        llm.engine.add_request("s", [1, 2, 3], GREEDY, adapter="all8")


def test_no_step_runs_more_adapters_than_max_loras(zoo, adapters):
    """With --max-loras 1 a request of a second adapter waits until the first adapter's requests end
    (base rows run beside either), and every output is still its adapter's."""
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=64, enable_lora=True, max_loras=1)
    seen: list[set] = []
    prepare = llm.engine.adapters.prepare

    def spy(items):
        seen.append({item.adapter for item in items})
        prepare(items)

    llm.engine.adapters.prepare = spy
    names = ["all8", "mlp8", None, "all8", "mlp8", None]
    prompts = [[30 + i, 7, 90 + 2 * i] * 4 for i in range(len(names))]
    requests = [None if n is None else LoRARequest(n, 1, str(adapters[n][0])) for n in names]
    outs = llm.generate(prompts, GREEDY, lora_request=requests, use_tqdm=False)
    assert max(len(s - {None}) for s in seen) == 1 and set().union(*seen) == {"all8", "mlp8", None}
    assert seen[0] == {"all8", None}  # the base request started beside the first adapter's, past the held one
    for prompt, name, out in zip(prompts, names, outs):
        want = zoo.hf_greedy("llama-gqa", prompt, 12) if name is None else greedy(adapters[name][1], prompt, 12)
        assert out.outputs[0].token_ids == want, name


def test_an_adapter_on_a_hybrid_model_keeps_its_own_prefix_in_every_lane(zoo, tmp_path):
    """Gemma 3 (a full lane and five sliding ones of window 8, blocks of 4): a prompt five windows
    long under the base model and under an adapter, twice: each equals transformers (+ PEFT merged)
    past the window, and the second round hits each one's own prefix in every lane, never the other's."""
    merged = make_adapter(zoo, "gemma3", tmp_path / "a", 8, ALL_TARGETS, seed=3)
    llm = LLM(zoo.path("gemma3"), device="cpu", dtype="float32", block_size=4, num_gpu_blocks=256, enable_lora=True)
    assert llm.engine.runner.model.kv_layout.hybrid
    prompt = [11 + (i * 7) % 400 for i in range(41)]
    want = [zoo.hf_greedy("gemma3", prompt, 12), greedy(merged, prompt, 12)]
    assert want[0] != want[1]
    for round in range(2):
        outs = llm.generate([prompt, prompt], [GREEDY, GREEDY], lora_request=[None, LoRARequest("a", 1, str(tmp_path / "a"))],
                            use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want, round
    assert llm.engine.stats()["prefix_cache_hits_total"] == 2 * 40  # the second round: both prompts' 10 blocks


def test_rslora_scales_by_the_square_root_of_the_rank_as_peft_does(zoo, tmp_path):
    """``use_rslora``: alpha / sqrt(r), not alpha / r. The same weights without it answer otherwise, so
    the equality says the scale is PEFT's."""
    stabilized = make_adapter(zoo, "llama-gqa", tmp_path / "rs", 8, ALL_TARGETS, seed=9, use_rslora=True)
    plain = make_adapter(zoo, "llama-gqa", tmp_path / "plain", 8, ALL_TARGETS, seed=9)
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=32, enable_lora=True)
    prompt = [10, 20, 7, 300] * 4
    ours = llm.generate([prompt], GREEDY, lora_request=LoRARequest("rs", 1, str(tmp_path / "rs")), use_tqdm=False)
    assert list(ours[0].outputs[0].token_ids) == greedy(stabilized, prompt, 12) != greedy(plain, prompt, 12)


@pytest.mark.parametrize("field, value, message", [
    ("alpha_pattern", {"q_proj": 4}, "alpha_pattern is not supported"),
    ("modules_to_save", ["lm_head"], r"modules_to_save \['lm_head'\] are not supported"),
    ("bias", "lora_only", r"trained biases \(bias='lora_only'\) are not supported"),
])
def test_what_an_adapter_trains_besides_its_lora_layers_is_refused(zoo, adapters, tmp_path, field, value, message):
    """What PEFT can train that the LoRA layers cannot run as written: refused with the field named,
    nothing loaded (served, it would answer as another model)."""
    import shutil

    copy = shutil.copytree(adapters["all8"][0], tmp_path / field)
    config = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**config, field: value}))
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=16, enable_lora=True)
    with pytest.raises(LoraError, match=message):
        llm.engine.load_adapter("a", str(copy))
    assert not llm.engine.adapters.loaded
    llm.engine.load_adapter("a", str(adapters["all8"][0]))  # the same adapter as trained loads
