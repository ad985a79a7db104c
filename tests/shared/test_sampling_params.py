"""SamplingParams validation: every bad value is a typed error naming its field."""

import pytest

from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams


@pytest.mark.parametrize(
    "field,value",
    [
        ("n", 0), ("n", 1.5), ("max_tokens", 0), ("max_tokens", True), ("min_tokens", -1),
        ("temperature", -0.1), ("temperature", float("nan")), ("top_k", -2), ("top_p", 0.0),
        ("top_p", 1.1), ("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3),
        ("repetition_penalty", 0.0), ("logprobs", 21), ("logprobs", -1), ("seed", "x"),
        ("stop", [""]), ("stop", [3]), ("stop_token_ids", [-1]), ("ignore_eos", "yes"),
    ],
)
def test_out_of_range_values_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field
    assert field in str(err.value)


def test_min_tokens_above_max_tokens():
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_normalisation_and_round_trip():
    p = SamplingParams(stop="END", stop_token_ids=[5, 6], top_k=-1, temperature=0)
    assert p.stop == ("END",) and p.stop_token_ids == (5, 6) and p.top_k == 0 and p.greedy
    assert SamplingParams.from_dict(p.to_dict()) == p
    with pytest.raises(InvalidRequestError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"temprature": 1.0})


@pytest.mark.parametrize("name", ["n", "max_tokens", "temperature", "top_p", "beam_width"])
def test_a_required_number_given_as_none_is_refused(name):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{name: None})
    assert err.value.field == name
