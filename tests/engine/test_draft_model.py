"""Speculative decoding with a draft model (``{"model": ...}``): its drafts are checked as prompt
lookup's are, so the tokens never change; and its own KV, kept on the target's block ids, is right
where it is used: a draft that is the target itself has (nearly) every draft kept, through
preemption by recompute and by swap, which a draft reading stale KV would not."""

from __future__ import annotations

import random

import pytest

from pagedserve.shared.sampling import SamplingParams
from tests.engine.test_speculative import engine, outputs

MODEL = "llama-gqa"


def draft(zoo, name: str = MODEL, k: int = 4, **extra) -> dict:
    return {"model": str(zoo.path(name)), "num_speculative_tokens": k, **extra}


def random_batch(count: int, seed: int) -> list[list[int]]:
    """Prompts that do not repeat themselves: prompt lookup would find nothing in them."""
    rng = random.Random(seed)
    return [[rng.randint(10, 500) for _ in range(rng.randint(2, 40))] for _ in range(count)]


def kept_share(llm) -> float:
    stats = llm.engine.scheduler.applier.spec_stats
    assert stats.draft_tokens > 0
    return stats.accepted_tokens / stats.draft_tokens


@pytest.mark.parametrize("small", [{}, dict(num_gpu_blocks=12, max_num_seqs=6),
                                   dict(num_gpu_blocks=12, max_num_seqs=6, preemption_mode="swap", swap_space=1 << 24)],
                         ids=["roomy", "recompute", "swap"])
def test_the_target_as_its_own_draft_has_its_drafts_kept(zoo, small):
    batch = random_batch(8, seed=len(small))
    params = [SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)] * len(batch)
    spec = engine(zoo, draft(zoo), **small)
    assert outputs(spec, batch, params) == outputs(engine(zoo, **small), batch, params)
    assert kept_share(spec) > 0.95
    if small:
        assert spec.engine.scheduler.stats.num_preemptions > 0


def test_another_models_drafts_change_no_token_greedy_or_seeded(zoo):
    batch = random_batch(6, seed=11)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.7, seed=i, max_tokens=24, ignore_eos=True, logprobs=1) for i in range(len(batch))]
    spec = engine(zoo, draft(zoo, "llama-mha", k=3))
    assert outputs(spec, batch, params) == outputs(engine(zoo), batch, params)
    assert kept_share(spec) < 0.5  # random weights of its own: its drafts are mostly wrong


def test_a_quantized_draft_and_a_long_context_to_catch_up(zoo):
    """int8 weights for the draft; a prompt longer than one catch-up piece (drafter.CATCH_UP_CHUNK)."""
    from pagedserve.worker.runner.speculative import draft_model as drafter

    batch = random_batch(2, seed=3) + [[random.Random(4).randint(10, 500) for _ in range(drafter.CATCH_UP_CHUNK + 70)]]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * len(batch)
    spec = engine(zoo, draft(zoo, quantization="int8"), max_model_len=2048)
    assert outputs(spec, batch, params) == outputs(engine(zoo, max_model_len=2048), batch, params)
    assert kept_share(spec) > 0.8


def test_a_draft_that_is_not_there_is_named_as_the_draft(zoo, tmp_path):
    with pytest.raises(ValueError, match="the speculative draft model: .*no-such-draft"):
        engine(zoo, {"model": str(tmp_path / "no-such-draft"), "num_speculative_tokens": 2})


def test_a_draft_of_another_vocabulary_is_refused(zoo, tmp_path):
    from pagedserve.worker.source.demo_model import build_model

    other = build_model(tmp_path / "other-vocab", family="llama", num_heads=4, num_kv_heads=2, vocab_size=700, seed=1)
    with pytest.raises(ValueError, match="vocabulary"):
        engine(zoo, {"model": str(other), "num_speculative_tokens": 2})


def test_a_draft_quantization_the_kernels_lack_is_refused_before_loading():
    from pagedserve.worker.setup.engine_config import EngineConfig

    with pytest.raises(ValueError, match="int8, int4"):
        EngineConfig(model="demo", speculative_config={"model": "d", "quantization": "int3"})


def test_a_batch_makes_no_first_pass_before_its_steps_are_priced():
    """Several rows and a step cost not yet fitted: a draft model's first pass over a prompt (a
    prefill's cost) waits; a row whose draft KV is nearly caught up still drafts, one token."""
    from pagedserve.worker.core.scheduling.config import SchedulerConfig
    from pagedserve.worker.core.scheduling.drafts import row_draft
    from pagedserve.worker.core.scheduling.request import Request, Sequence
    from pagedserve.worker.core.speculative.config import SpeculativeConfig

    config = SchedulerConfig(num_gpu_blocks=64, speculative=SpeculativeConfig(method="draft_model", model="d"))

    def draft(draft_computed: int, blind: bool):
        seq = Sequence(0, list(range(10, 110)), prompt_len=100, num_computed=99, draft_computed=draft_computed)
        req = Request("r", list(seq.token_ids), SamplingParams(temperature=0.0, max_tokens=20), 0.0, 0, seqs=[seq])
        return row_draft(config, req, seq, 1, 10, 0.0, None, blind)

    assert draft(0, blind=True) is None
    made = draft(0, blind=False)
    assert made.tokens == (0, 0, 0, 0) and made.draft_context == tuple(range(10, 109))
    caught_up = draft(95, blind=True)
    assert caught_up.draft_context == tuple(range(105, 109)) and caught_up.tokens == (0,)


def test_a_draft_model_beside_grammar_constrained_rows_changes_no_token(zoo):
    """Rows under a JSON schema and free rows in one batch, drafted by a model: a draft is cut where
    the row's grammar refuses it (every drafted position masked), so the constrained rows end valid
    and every row's tokens are the ones without a draft."""
    import json

    from pagedserve.shared.structured import StructuredOutputs
    from tests.engine.test_speculative import finished

    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["page", "block"]},
                                                        "minItems": 2, "maxItems": 4}},
              "required": ["tags"], "additionalProperties": False}
    batch = random_batch(6, seed=21)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured=StructuredOutputs(json=schema))
              if i % 2 else SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) for i in range(len(batch))]
    spec = engine(zoo, draft(zoo))
    ours = finished(spec, batch, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in finished(engine(zoo), batch, params)]
    for i in range(1, len(batch), 2):
        assert ours[i].finish_reason == "stop" and json.loads(ours[i].text)["tags"]
    assert kept_share(spec) > 0.5  # the target drafting itself: its drafts hold where the grammar lets them
