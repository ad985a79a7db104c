"""Speculative decoding by prompt lookup on the real engine: greedy output is token for token what
the engine gives without it (and what transformers gives), with drafts accepted, under
preemption, beside sampled rows, with stops and ``max_tokens`` landing inside an accepted run;
seeded sampled rows (penalties, logprobs) and structured outputs get their tokens unchanged too,
with drafts kept; the block manager's invariants hold after every step and nothing leaks. Each
row paces its drafts: one whose drafts keep failing drafts rarely."""

from __future__ import annotations

import random

import pytest

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
from pagedserve.shared.structured import StructuredOutputs
from pagedserve.worker.core.scheduling.config import SchedulerConfig
from pagedserve.worker.core.scheduling.drafts import row_draft
from pagedserve.worker.core.scheduling.kv_snapshot import kv_snapshot
from pagedserve.worker.core.scheduling.request import Request, Sequence
from pagedserve.worker.core.speculative.config import MAX_DRAFT_WAIT, DraftPace, SpeculativeConfig
from pagedserve.worker.core.speculative.draft_cost import StepCost, StepFit
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
    """With speculation, rows draft as their pace allows whatever a step costs (no ``StepCost``:
    which drafts pay off on this machine's timings is tested on its own, below)."""
    llm = LLM(zoo.path(MODEL), device="cpu", dtype="float32", seed=0, speculative_config=speculative, **kwargs)
    llm.engine.scheduler.step_cost = None
    return llm


def slots_match_tokens(engine) -> None:
    """After a step every running sequence holds slots for its computed tokens only: a rejected
    draft's slot went back, and a block it alone used went back to the pool."""
    blocks = engine.scheduler.blocks
    for req in engine.scheduler.running:
        for seq in req.live_seqs:
            assert blocks.num_slots(seq.seq_id) == seq.num_computed, f"seq {seq.seq_id} kept a rejected draft's slot"
            assert len(blocks.block_table(seq.seq_id)) == blocks.blocks_for(seq.num_computed)


def finished(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> list:
    done = run_checked(llm, batch, params, slots_match_tokens)
    return [done[i].outputs[0] for i in range(len(batch))]


def outputs(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    return [list(out.token_ids) for out in finished(llm, batch, params)]


def accepted(llm: LLM) -> int:
    return llm.engine.scheduler.applier.spec_stats.accepted_tokens


def test_greedy_tokens_are_the_engines_and_transformers_with_drafts_accepted(zoo):
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
    dashboard = kv_snapshot(spec.engine.scheduler)["figures"]
    assert (dashboard["spec_draft_tokens"], dashboard["spec_accepted_tokens"]) == (stats.draft_tokens, stats.accepted_tokens)
    assert "spec_draft_tokens" not in kv_snapshot(engine(zoo).engine.scheduler)["figures"]


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
    ("{not json", "not JSON"), ("[1]", "JSON object"), ({"method": "ngram", "model": "d"}, "draft model"), ({"model": "d", "quantization": 4}, "quantization"),
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
    assert spec.propose([5, 1, 6, 1], 10) == (6, 1, 6)  # the latest of equal matches, then its loop
    assert spec.propose([1, 2, 3, 4], 10) == () and spec.propose([4, 4], 0) == ()
    assert spec.propose([1, 2, 1, 2], 10) == (1, 2, 1)  # past the end, the loop goes on
    assert SpeculativeConfig(num_speculative_tokens=7).propose([9, 5, 6, 7, 5, 6, 7, 5], 10) == (6, 7, 5, 6, 7, 5, 6)
    assert SpeculativeConfig(prompt_lookup_min=2).propose([5, 1, 6, 1], 10) == ()


def test_seeded_sampled_rows_keep_their_tokens_and_logprobs_with_penalties(zoo):
    """A draft is checked by the row's own seeded draw at each position, with the drafts before it
    as history: the same tokens as one step at a time, and the target's logprobs."""
    batch = prompts(8, seed=21)
    params = [SamplingParams(temperature=0.8 if i % 2 else 0.02, top_k=0 if i % 2 else 5, top_p=0.9, seed=i,
                             max_tokens=32, ignore_eos=True, logprobs=2, repetition_penalty=1.0 + 0.05 * (i % 3),
                             frequency_penalty=0.1 * (i % 4 > 1)) for i in range(8)]  # near greedy: drafts kept
    spec = engine(zoo, NGRAM)
    ours, plain = finished(spec, batch, params), finished(engine(zoo), batch, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in plain]
    for a, b in zip(ours, plain):
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert x.top_logprobs.keys() == y.top_logprobs.keys()
            assert all(abs(x.top_logprobs[t] - y.top_logprobs[t]) < 1e-4 for t in x.top_logprobs)
    stats = spec.engine.scheduler.applier.spec_stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens


def test_structured_rows_draft_only_what_their_grammar_allows(zoo):
    """JSON under a schema repeats its keys and punctuation: drafts are cut where the grammar
    refuses, every position is masked, and the seeded outputs are the ones without drafts."""
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["page", "block"]},
                                                        "minItems": 3, "maxItems": 6}},
              "required": ["tags"], "additionalProperties": False}
    batch = [[11, 12, 13 + i] for i in range(6)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=80, structured=StructuredOutputs(json=schema))
              for i in range(6)]
    spec = engine(zoo, NGRAM)
    ours = finished(spec, batch, params)
    assert [o.token_ids for o in ours] == [o.token_ids for o in finished(engine(zoo), batch, params)]
    assert all(o.finish_reason == "stop" for o in ours) and accepted(spec) > 0


def test_a_row_whose_drafts_fail_drafts_less_and_less_often():
    pace = DraftPace(limit=6)
    waits = []
    for _ in range(7):
        assert pace.ready()
        pace.checked(pace.length, 0)
        waits.append(pace.wait)
        while not pace.ready():
            pass
        pace.wait = 0
    assert waits == [1, 3, 7, 15, min(31, MAX_DRAFT_WAIT), MAX_DRAFT_WAIT, MAX_DRAFT_WAIT] and pace.length == 1
    pace.checked(1, 1)  # anything kept: back to the limit
    assert (pace.length, pace.misses) == (6, 0)
    pace.checked(6, 2)  # kept in part: the limit still (worth cuts it by the kept rate)
    assert pace.length == 6


def test_the_pace_skips_steps_and_caps_the_draft():
    spec = SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=2)
    config = SchedulerConfig(num_gpu_blocks=8, speculative=spec)
    seq = Sequence(0, [1, 2, 3, 4, 5, 6, 1, 2], prompt_len=8)
    req = Request("r", list(seq.token_ids), SamplingParams(max_tokens=20), 0.0, 0, seqs=[seq])

    def draft(budget=11):
        made = row_draft(config, req, seq, 1, budget, 0.0)
        return made.tokens if made else ()

    seq.num_computed = 7
    assert draft() == (3, 4, 5, 6, 1)
    seq.draft_pace.checked(5, 0)  # nothing kept: the next step waits, then one token
    assert draft() == () and draft() == (3,)
    seq.draft_pace = None
    assert draft(budget=2) == (3,)  # the step's budget caps it


def test_a_draft_is_only_as_long_as_its_tokens_pay_for_themselves():
    pace = DraftPace(limit=6)
    assert pace.kept_rate == 0.5 and pace.worth(0.0) == 6 and pace.worth(1.0) == 0
    assert pace.worth(0.3) == 1  # 0.5 > 0.3 > 0.25: the second token would be kept too rarely
    for _ in range(20):
        pace.checked(6, 6)
    assert pace.kept_rate > 0.95 and pace.worth(0.3) == 6
    for _ in range(60):  # older checks fade: 0.9 ** 60 of them is left
        pace.checked(4, 1)  # one kept, the next rejected: a kept rate of 1/2
    assert abs(pace.kept_rate - 0.5) < 0.01 and pace.worth(0.2) == 2


def test_the_step_cost_share_grows_with_the_rows_a_step_carries():
    cost = StepFit()
    assert cost.token_share(16) == 0.0  # nothing seen: draft freely
    for tokens in [1, 4, 16, 64, 100, 3, 30] * 3:
        cost.observe(tokens, 0.030 + 0.002 * tokens)  # 30 ms fixed, 2 ms a token
    assert abs(cost.token_share(1) - 0.002 / 0.032) < 1e-6
    assert abs(cost.token_share(16) - 0.032 / 0.062) < 1e-6
    assert cost.token_share(64) > 0.8
    flat = StepFit()
    for tokens in [1, 4, 16, 64] * 3:
        flat.observe(tokens, 0.030)  # a step that costs the same whatever it carries
    assert flat.token_share(64) < 1e-9


def test_a_draft_round_is_priced_and_steps_all_alike_ask_for_one_without_drafts():
    cost = StepCost()
    for _ in range(10):  # 16 rows drafting 4 each: 80 tokens, 0.26 s of target and 4 draft rounds of 0.01 s
        cost.observe(16, 80, 0.30, drafted=True, draft_rounds=4, draft_seconds=0.04)
    assert cost.share(16) == (1.0, False)  # a plain step, please
    cost.observe(16, 16, 0.086)  # the plain step it asked for: 16 rows, 0.086 s
    share, blind = cost.share(16)
    per_token = (0.26 - 0.086) / 64
    assert not blind and abs(share - (16 * per_token + 0.01) / 0.086) < 1e-6
    never = StepCost()
    for _ in range(10):  # steps that never drafted, all alike: draft freely, ask for nothing
        never.observe(1, 1, 0.05)
    assert never.share(1) == (0.0, False)


def test_each_batch_size_is_priced_by_its_own_steps():
    """One-row steps that read (a token costs nothing) do not price a 16-row step that computes;
    until its own steps do, a batch is blind (one drafted token at most)."""
    cost = StepCost()
    for tokens in [1, 7, 1, 4] * 4:
        cost.observe(1, tokens, 0.030 + 0.0001 * tokens)  # one row: a token costs 0.3% of a step
    assert cost.share(1)[0] < 0.01 and cost.share(1)[1] is False
    assert cost.share(16) == (0.0, True) and cost.share(9) == (0.0, True)  # rows 9-16: nothing seen
    assert cost.share(2) == (0.0, True) and cost.bucket(1) != cost.bucket(2) != cost.bucket(3) == cost.bucket(4)
    for tokens in [16, 32, 20, 16] * 4:
        cost.observe(14, tokens, 0.040 + 0.002 * tokens)  # 9-16 rows: a token costs 2 ms
    share, blind = cost.share(16)
    assert not blind and abs(share - 0.032 / 0.072) < 1e-6
    assert cost.share(17) == (0.0, True) and cost.share(1)[0] < 0.01  # other sizes untouched


class FrozenCost(StepCost):
    """A step cost fitted once, on steps of every batch size up to 8 rows where each token costs
    10 ms and the rest 1 ms."""

    def __init__(self) -> None:
        super().__init__()
        for rows in (1, 2, 4, 8):
            for tokens in (1, 2, 8, 32) * 4:
                super().observe(rows, tokens, 0.001 + 0.010 * tokens)

    def observe(self, *step, **draft) -> None:
        pass


def test_the_engine_fits_its_step_cost_and_drafts_nothing_where_a_token_costs_a_step(zoo):
    llm = LLM(zoo.path(MODEL), device="cpu", dtype="float32", seed=0, speculative_config=NGRAM)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 6
    outputs(llm, prompts(6), params)
    assert llm.engine.scheduler.step_cost.fit(6).seen.weight > 0  # the steps of 6 rows were timed
    stats = llm.engine.scheduler.applier.spec_stats
    before = stats.draft_tokens
    llm.engine.scheduler.step_cost = FrozenCost()
    assert llm.engine.scheduler.step_cost.share(6)[0] > 0.95
    assert outputs(llm, prompts(6, seed=7), params) == outputs(engine(zoo), prompts(6, seed=7), params)
    assert stats.draft_tokens == before  # no draft pays for itself there


def test_a_new_row_starts_from_what_recent_rows_of_its_kind_kept():
    """Sampled rows whose drafts were rejected make the next sampled row skip its first draft
    where a token costs half a step; a greedy row still drafts."""
    from pagedserve.worker.core.speculative.config import SpecStats

    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2)
    config = SchedulerConfig(num_gpu_blocks=8, speculative=spec)
    stats = SpecStats()
    for _ in range(10):
        stats.record(2, 0, greedy=False)
        stats.record(2, 2, greedy=True)

    def first_draft(params: SamplingParams) -> tuple[int, ...]:
        seq = Sequence(0, [1, 2, 3, 4, 5, 6, 1, 2], prompt_len=8, num_computed=7)
        req = Request("r", list(seq.token_ids), params, 0.0, 0, seqs=[seq])
        made = row_draft(config, req, seq, 1, 10, 0.5, stats.lately)
        return made.tokens if made else ()

    assert first_draft(SamplingParams(temperature=1.0, max_tokens=20)) == ()
    assert first_draft(SamplingParams(temperature=0.0, max_tokens=20)) == (3, 4, 5, 6)
    assert stats.lately[False].value < 0.1 < 0.9 < stats.lately[True].value


def test_a_blind_batch_drafts_one_token_at_most():
    """Several rows whose step cost is not priced: lookup's draft is cut to one token."""
    config = SchedulerConfig(num_gpu_blocks=8, speculative=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2))

    def draft(blind: bool) -> tuple[int, ...]:
        seq = Sequence(0, [1, 2, 3, 4, 5, 6, 1, 2], prompt_len=8, num_computed=7)
        req = Request("r", list(seq.token_ids), SamplingParams(temperature=0.0, max_tokens=20), 0.0, 0, seqs=[seq])
        return row_draft(config, req, seq, 1, 10, 0.0, None, blind).tokens

    assert draft(blind=False) == (3, 4, 5, 6) and draft(blind=True) == (3,)
