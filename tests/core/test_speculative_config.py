"""Speculative decoding's pure parts (``worker/core/speculative/config.py``) on their own: prompt
lookup's proposals at their edges, the pace's worth at the edges of its rate and share, the rows that
price drafts, the counters, and ``--speculative-config`` read as vLLM writes it, each refusal in words."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedserve.worker.core.speculative.config import (MAX_DRAFT_WAIT, DraftPace, KeptRate, SpecStats, SpeculativeConfig,
                                                       prices_drafts)


def test_prompt_lookup_proposes_what_followed_the_latest_match_at_the_edges():
    ngram = SpeculativeConfig(num_speculative_tokens=3)
    assert ngram.propose([7], 3) == () and ngram.propose([], 3) == ()
    assert ngram.propose([5, 5], 3) == (5, 5, 5)  # two tokens are enough: the loop keeps looping
    assert ngram.propose([1, 2, 2], 3) == (2, 2, 2)  # the token just before the last is a match too
    assert ngram.propose([1, 5, 2, 5, 3, 5], 2) == (3, 5)  # of equal matches, the latest
    assert ngram.propose([1, 5, 2, 5, 3, 5], 0) == ()
    assert SpeculativeConfig(prompt_lookup_min=2).propose([2, 2], 3) == ()  # nothing before the start matches
    assert SpeculativeConfig(prompt_lookup_min=2).propose([4, 2, 2, 4, 2], 1) == (2,)  # [4, 2] once before


def test_a_rows_rate_starts_from_what_similar_rows_kept_and_fades():
    assert KeptRate(3.0, 4.0).start() == KeptRate(1.5, 2.0)
    rate = KeptRate()
    rate.update(4, 2)  # two kept, the third rejected: three checked
    assert (rate.kept, rate.checked) == pytest.approx((0.9 + 2, 1.8 + 3))
    rate.update(3, 3)  # all kept: nothing rejected
    assert (rate.kept, rate.checked) == pytest.approx((0.9 * 2.9 + 3, 0.9 * 4.8 + 3))


def test_a_drafts_worth_at_the_edges_of_its_rate_and_share():
    pace = DraftPace(6)
    assert pace.worth(-0.1) == 6 and pace.worth(0.0) == 6  # checking is free: the whole draft
    assert pace.worth(1.0) == 0 and pace.worth(2.0) == 0  # a checked token costs a step: none
    sure = DraftPace(6, rate=KeptRate(2.0, 2.0))
    assert sure.worth(0.9) == 6  # always kept
    never = DraftPace(6, rate=KeptRate(0.0, 2.0))
    assert never.worth(0.01) == 0  # never kept
    often = DraftPace(6, rate=KeptRate(1.8, 2.0))  # 0.9: log(0.01) / log(0.9) = 43 tokens would pay
    assert often.worth(0.01) == 6
    often.checked(6, 0)  # a miss: the next draft is one token, after one step without
    assert often.worth(0.01) == 1 and (often.wait, often.misses) == (1, 1)
    assert not often.ready() and often.ready()
    for _ in range(10):
        often.checked(1, 0)
    assert often.wait == MAX_DRAFT_WAIT
    often.checked(1, 1)
    assert (often.length, often.misses) == (6, 0)


def test_only_decode_rows_that_caught_up_price_drafts():
    row = lambda tokens, draft, context=None: SimpleNamespace(num_tokens=tokens, num_draft=draft,  # noqa: E731
                                                              draft_context=context)
    assert prices_drafts(row(1, 0)) and prices_drafts(row(5, 4))
    assert not prices_drafts(row(5, 0)) and not prices_drafts(row(4, 4))  # a prefill chunk; a miscounted draft
    assert prices_drafts(row(3, 2, [1] * (MAX_DRAFT_WAIT + 1)))
    assert not prices_drafts(row(3, 2, [1] * (MAX_DRAFT_WAIT + 2)))  # a draft model's first pass over a prompt


def test_the_counters_and_the_recent_rates_by_kind():
    stats = SpecStats()
    stats.record(4, 2, greedy=False)
    stats.record(3, 3)
    assert (stats.drafts, stats.draft_tokens, stats.accepted_tokens) == (2, 7, 5)
    assert stats.accepted_by_position[:4] == [2, 2, 1, 0]
    assert stats.lately[False].checked == pytest.approx(1.8 + 3) and stats.lately[True].checked == pytest.approx(1.8 + 3)
    assert stats.lately[False].kept == pytest.approx(0.9 + 2) and stats.lately[True].kept == pytest.approx(0.9 + 3)


def test_the_config_is_read_as_vllm_writes_it_and_each_refusal_says_why():
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 2}') == SpeculativeConfig(2)
    draft = SpeculativeConfig.parse({"model": "/m", "quantization": "int8"})
    assert (draft.method, draft.model, draft.quantization) == ("draft_model", "/m", "int8")
    assert SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=3).prompt_lookup_min == 3
    assert SpeculativeConfig(num_speculative_tokens=16).num_speculative_tokens == 16
    refusals = [
        ("[1]", "--speculative-config must be a JSON object"),
        ("{", "--speculative-config is not JSON"),
        ('{"method": "ngram", "b": 1, "a": 2}', "unknown --speculative-config keys: a, b (known: method, model, "
                                                 "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min, quantization)"),
        ('{"num_speculative_tokens": 2}', '--speculative-config needs "method" ("ngram") or "model" (a draft model)'),
        ('{"method": "eagle"}', "speculative method 'eagle' is not supported (only 'ngram', 'draft_model')"),
        ('{"method": "draft_model"}', 'a speculative draft model needs "model" (a path), and "model" needs method "draft_model"'),
        ('{"method": "ngram", "num_speculative_tokens": 17}', "speculative num_speculative_tokens must be <= 16, got 17"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "speculative num_speculative_tokens must be a positive integer, got True"),
        ('{"method": "ngram", "prompt_lookup_max": 0}', "speculative prompt_lookup_max must be a positive integer, got 0"),
        ('{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
         "speculative prompt_lookup_min (3) must be <= prompt_lookup_max (2)"),
        ('{"model": ""}', "speculative model must be a path, got ''"),
        ('{"model": "/m", "quantization": 8}', "speculative quantization must be a name, got 8"),
    ]
    for text, message in refusals:
        with pytest.raises(ValueError) as err:
            SpeculativeConfig.parse(text)
        assert str(err.value).startswith(message), (text, str(err.value))
