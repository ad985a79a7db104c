"""SamplingParams validation: every bad value is a typed error naming its field."""

import pytest

from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.sampling import SamplingParams


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


@pytest.mark.parametrize("kwargs, field, words", [
    (dict(early_stopping="NEVER"), "early_stopping", 'true, false or "never"'),
    (dict(early_stopping="always"), "early_stopping", 'true, false or "never"'),
    (dict(n=3, best_of=2), "best_of", ">= n"),
    (dict(use_beam_search=True, beam_width=2, n=3), "n", "must be <= beam_width"),
    (dict(use_beam_search=True, beam_width=2, stop=("x",)), "use_beam_search", "neither best_of nor stop"),
    (dict(use_beam_search=True, beam_width=2, best_of=2), "use_beam_search", "neither best_of nor stop"),
])
def test_search_parameters_that_contradict_each_other_are_refused(kwargs, field, words):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field and words in str(err.value)


@pytest.mark.parametrize("kwargs", [dict(early_stopping=True), dict(early_stopping=False), dict(early_stopping="never"),
                                    dict(use_beam_search=True, beam_width=3, n=3), dict(n=2, best_of=2)])
def test_search_parameters_at_their_limits_are_accepted(kwargs):
    assert SamplingParams(**kwargs)


def test_wire_parameters_name_what_is_wrong():
    with pytest.raises(InvalidRequestError, match="names must be strings") as err:
        SamplingParams.from_dict({1: 2})
    assert err.value.field == "params"
    with pytest.raises(InvalidRequestError, match="unknown sampling parameter.s.: bogus, other") as err:
        SamplingParams.from_dict({"bogus": 1, "other": 2})
    assert err.value.field == "bogus"


@pytest.mark.parametrize("ids, ok", [((0,), True), ((2**31 - 1,), True), ((2**31,), False), ((-1,), False),
                                     ((True,), False), (("7",), False)])
def test_stop_token_ids_are_int32_token_ids(ids, ok):
    if ok:
        assert SamplingParams(stop_token_ids=ids).stop_token_ids == ids
    else:
        with pytest.raises(InvalidRequestError, match=r"stop_token_ids must be integers in \[0, 2147483648\)"):
            SamplingParams(stop_token_ids=ids)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n must be >= 1, got 0"),
    (dict(top_p=0.0), "top_p must be in (0.0, 1.0], got 0.0"),
    (dict(temperature=101), "temperature must be in [0.0, 100.0], got 101"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens (5) must be <= max_tokens (4)"),
])
def test_range_errors_say_the_range(kwargs, message):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert str(err.value) == message and err.value.field == next(iter(kwargs))


@pytest.mark.parametrize("name, value", [("stop", 5), ("stop", 0), ("stop_token_ids", 7), ("stop_token_ids", {1: 2})])
def test_lists_given_as_something_else_are_refused_by_name(name, value):
    with pytest.raises(InvalidRequestError, match=f"{name} must be a list") as err:
        SamplingParams(**{name: value})
    assert err.value.field == name
