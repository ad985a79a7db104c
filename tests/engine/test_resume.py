"""A request resumed from the tokens a client already has (``resume_output``, what a worker taking
over after a crash gets) goes on exactly as the uninterrupted run: same tokens, same text, same
finish, for greedy, seeded, penalised and stop-string requests."""

import pytest

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams

PROMPT = [30, 31, 32, 33]


@pytest.fixture(scope="module")
def llm(zoo):
    return LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=512, block_size=16)


def stream(engine, request_id, params, resume=()):
    """(token ids, text deltas, finish reason, total output tokens) of one request, step by step."""
    engine.add_request(request_id, PROMPT, params, resume_output=resume)
    tokens, deltas, finish, total = [], [], None, 0
    while engine.has_unfinished():
        for out in engine.step():
            o = out.outputs[0]
            tokens += o.new_token_ids
            deltas.append(o.text_delta)
            if out.finished:
                finish, total = o.finish_reason, len(o.token_ids)
    return tokens, deltas, finish, total


CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    "seeded": SamplingParams(temperature=1.0, top_k=40, seed=11, max_tokens=24, ignore_eos=True),
    "penalised": SamplingParams(temperature=1.0, seed=3, repetition_penalty=1.4, presence_penalty=0.6,
                                frequency_penalty=0.3, min_tokens=20, max_tokens=24),
}


@pytest.mark.parametrize("cut", [1, 9])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resumed_request_goes_on_as_the_uninterrupted_one(llm, case, cut):
    params = CASES[case]
    tokens, deltas, finish, total = stream(llm.engine, f"{case}-{cut}-whole", params)
    assert len(tokens) == 24 and finish == "length"
    # One token per step: after ``cut`` steps the client had tokens[:cut] and the text of those steps.
    rest, rest_deltas, rest_finish, rest_total = stream(llm.engine, f"{case}-{cut}-resumed", params, tokens[:cut])
    assert tokens[:cut] + rest == tokens
    assert "".join(deltas[:cut]) + "".join(rest_deltas) == "".join(deltas)
    assert (rest_finish, rest_total) == (finish, total)
    assert llm.engine.scheduler.blocks.usage().used == 0


def test_a_stop_string_after_the_cut_still_stops(llm):
    seeded = dict(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)  # greedy text of random weights loops
    tokens, deltas, _, _ = stream(llm.engine, "plain", SamplingParams(**seeded))
    text = "".join(deltas)
    cut_text = "".join(deltas[:6])
    # three characters that first appear well after the cut
    at = next(i for i in range(len(cut_text) + 4, len(text) - 3) if text.index(text[i : i + 3]) == i)
    stop = text[at : at + 3]
    with_stop = SamplingParams(**seeded, stop=[stop])
    whole, whole_deltas, whole_finish, _ = stream(llm.engine, "whole", with_stop)
    rest, rest_deltas, finish, _ = stream(llm.engine, "resumed", with_stop, tokens[:6])
    assert whole_finish == finish == "stop"
    assert "".join(whole_deltas[:6]) + "".join(rest_deltas) == "".join(whole_deltas) == text[: text.index(stop)]
    assert tokens[:6] + rest == whole


def test_resumed_tokens_outside_the_vocabulary_are_refused(llm):
    from pagedserve.shared.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        llm.engine.add_request("bad-resume", PROMPT, CASES["greedy"], resume_output=[10**9])
    assert err.value.field == "resume"
