"""Speculative decoding by prompt lookup on the real engine: greedy output is token for token what
the engine gives without it (and what transformers gives), with guesses accepted, under
preemption, beside sampled rows, with stops and ``max_tokens`` landing inside an accepted run; the
block manager's invariants hold after every step and nothing leaks."""

from __future__ import annotations

import random

import pytest

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.speculative import SpeculativeConfig
from tests.engine.test_parity import run_checked

MODEL = "llama-gqa"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def prompts(count: int, seed: int = 5) -> list[list[int]]:
    """Prompts that repeat themselves (a phrase quoted twice), so lookup finds something."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        phrase = [rng.randint(10, 500) for _ in range(rng.randint(6, 20))]
        out.append([rng.randint(10, 500) for _ in range(rng.randint(3, 30))] + phrase + [7] + phrase[: rng.randint(2, 5)])
    return out


def engine(zoo, speculative=None, **kwargs) -> LLM:
    return LLM(zoo.path(MODEL), device="cpu", dtype="float32", seed=0, speculative_config=speculative, **kwargs)


def slots_match_tokens(engine) -> None:
    """After a step every running sequence holds slots for its computed tokens only: a rejected
    guess's slot went back, and a block it alone used went back to the pool."""
    blocks = engine.scheduler.blocks
    for req in engine.scheduler.running:
        for seq in req.live_seqs:
            assert blocks.num_slots(seq.seq_id) == seq.num_computed, f"seq {seq.seq_id} kept a rejected guess's slot"
            assert len(blocks.block_table(seq.seq_id)) == blocks.blocks_for(seq.num_computed)


def outputs(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    done = run_checked(llm, batch, params, slots_match_tokens)
    return [list(done[i].outputs[0].token_ids) for i in range(len(batch))]


def test_greedy_tokens_are_the_engines_and_transformers_with_guesses_accepted(zoo):
    batch = prompts(6)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(batch)
    spec = engine(zoo, NGRAM)
    ours = outputs(spec, batch, params)
    assert ours == outputs(engine(zoo), batch, params)
    for prompt, tokens in zip(batch, ours):  # transformers stops at the end of turn; we ignore it
        reference = zoo.hf_greedy(MODEL, prompt, 24)
        assert tokens[: len(reference)] == reference
    stats = spec.engine.scheduler.applier.spec_stats
    assert stats.drafts > 0 and 0 < stats.accepted_tokens < stats.draft_tokens
    assert stats.accepted_by_position[0] >= stats.accepted_by_position[1] > 0
    figures = spec.engine.stats()
    assert (figures["spec_decode_num_drafts_total"], figures["spec_decode_num_accepted_tokens_total"]) == (
        stats.drafts, stats.accepted_tokens)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8, 13])
def test_max_tokens_and_stops_inside_an_accepted_run_end_it_there(zoo, max_tokens):
    batch = prompts(4, seed=max_tokens)
    plain = outputs(engine(zoo), batch, [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 4)
    stops = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[out[max_tokens - 1]])
             for out in plain]
    capped = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * 4
    spec = engine(zoo, NGRAM)
    assert outputs(spec, batch, capped) == [out[:max_tokens] for out in plain]
    assert outputs(spec, batch, stops) == [out[: out.index(out[max_tokens - 1]) + 1] for out in plain]


def test_under_preemption_and_beside_sampled_rows_nothing_changes(zoo):
    batch = prompts(10, seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True) if i % 3 else
              SamplingParams(temperature=0.8, seed=i, max_tokens=30, ignore_eos=True) for i in range(len(batch))]
    small = dict(num_gpu_blocks=14, block_size=16, max_num_seqs=6)  # ten requests of ~80 tokens: preempted
    spec = engine(zoo, NGRAM, **small)
    assert outputs(spec, batch, params) == outputs(engine(zoo, **small), batch, params)
    assert spec.engine.scheduler.stats.num_preemptions > 0 and spec.engine.scheduler.applier.spec_stats.accepted_tokens > 0


@pytest.mark.parametrize("bad, reason", [
    ("{not json", "not JSON"), ("[1]", "JSON object"), ({"model": "draft"}, "draft model"),
    ({"method": "eagle"}, "not supported"), ({"num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "positive"), ({"method": "ngram", "k": 2}, "unknown"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "<="),
    ({"method": "ngram", "num_speculative_tokens": 99}, "<= 16"),
])
def test_a_bad_speculative_config_is_refused_with_its_reason(bad, reason):
    with pytest.raises(ValueError, match=reason):
        SpeculativeConfig.parse(bad)


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3)
    assert spec.propose([1, 2, 3, 9, 9, 2, 3, 8, 1, 2, 3], 10) == (9, 9, 2)  # 3 tokens matched beat the later 2
    assert spec.propose([5, 1, 6, 1], 10) == (6, 1)  # the latest of equal matches
    assert spec.propose([1, 2, 3, 4], 10) == () and spec.propose([4, 4], 0) == ()
    assert spec.propose([1, 2, 1, 2], 10) == (1, 2)  # what is there, fewer than k
    assert SpeculativeConfig(prompt_lookup_min=2).propose([5, 1, 6, 1], 10) == ()
