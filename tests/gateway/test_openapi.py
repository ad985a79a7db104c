"""``/openapi.json`` states the ranges ``SamplingParams`` enforces, from the one table (``BOUNDS``)."""

import pytest

from pagedserve.gateway.bodies.parse import Limits
from pagedserve.gateway.service.openapi import OPENAPI
from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.sampling import BOUNDS, NOT_REQUEST_FIELDS, SamplingParams

SCHEMAS = OPENAPI["components"]["schemas"]
GATEWAY_CAPS = {"n": "max_n", "best_of": "max_n", "beam_width": "max_n", "max_tokens": "max_tokens"}


def test_the_spec_is_openapi_3_1_with_json_schema_nulls():
    assert OPENAPI["openapi"].startswith("3.1.")
    error = SCHEMAS["ErrorDetail"]["properties"]
    assert {"type": "null"} in error["param"]["anyOf"] and "nullable" not in str(OPENAPI)


@pytest.mark.parametrize("name", sorted(set(BOUNDS) - NOT_REQUEST_FIELDS))
def test_the_spec_range_is_the_range_sampling_params_enforce(name):
    nullable = SCHEMAS["CompletionRequest"]["properties"][name]["anyOf"]
    assert nullable[1] == {"type": "null"}  # null means "not set"
    schema = dict(nullable[0])
    bound = BOUNDS[name]
    if name in GATEWAY_CAPS:  # the gateway's own limit (--max-n, --max-tokens) can be lower than the engine's
        cap = getattr(Limits(), GATEWAY_CAPS[name])
        assert schema.pop("maximum") == min(cap, bound.high or cap)
        assert schema == {k: v for k, v in bound.json_schema().items() if k != "maximum"}
    else:
        assert schema == bound.json_schema()
    base = {"n": 1, "best_of": None} if name == "best_of" else {}
    edge = bound.low if not bound.low_open else bound.low + (1 if bound.kind is int else 1e-6)
    SamplingParams(**{**base, name: edge})  # the lowest value the spec admits is accepted
    below = bound.low if bound.low_open else bound.low - 1
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**{**base, name: below})
    assert err.value.field == name
    if bound.high is not None:
        SamplingParams(**{**base, name: bound.high})
        with pytest.raises(InvalidRequestError):
            SamplingParams(**{**base, name: bound.high + 1})


def test_the_spec_is_a_valid_openapi_3_1_document():
    from openapi_spec_validator import validate

    validate(OPENAPI)  # raises on any violation of the OpenAPI 3.1 schema


def test_every_path_declares_the_body_of_its_answer():
    for path, methods in OPENAPI["paths"].items():
        for method, operation in methods.items():
            if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):  # a line of text, as vLLM answers
                assert operation["responses"]["200"]["content"] == {"text/plain": {"schema": {"type": "string"}}}
            elif path not in ("/health", "/ready", "/metrics"):
                schema = operation["responses"]["200"]["content"]["application/json"]["schema"]
                assert schema["$ref"].split("/")[-1] in SCHEMAS, (method, path)
