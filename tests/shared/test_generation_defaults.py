"""A model's generation_config.json fills the sampling fields a request leaves unset (as vLLM does)."""

import json

import pytest

from pagedserve.gateway.bodies.parse import Limits, parse
from pagedserve.shared.sampling_defaults import generation_defaults


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "do_sample": True, "repetition_penalty": None, "eos_token_id": 2}))
    return tmp_path


def test_only_the_sampling_fields_that_are_set_are_read(model_dir, tmp_path_factory):
    assert generation_defaults(model_dir) == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert generation_defaults(model_dir, "vllm") == {}
    assert generation_defaults(tmp_path_factory.mktemp("bare")) == {}
    with pytest.raises(ValueError, match="'auto' or 'vllm'"):
        generation_defaults(model_dir, "hf")


def test_a_request_field_beats_the_default_and_unset_ones_take_it(model_dir):
    defaults = generation_defaults(model_dir)
    body = {"model": "m", "prompt": "hi", "temperature": 0.0}
    params = parse(body, False, Limits(), defaults).params
    assert (params.temperature, params.top_k, params.top_p) == (0.0, 20, 0.95)
    assert parse({"model": "m", "prompt": "hi"}, False, Limits()).params.temperature == 1.0
