"""The gateway tests' stack: a real redis-server, an in-process worker with the real engine, gateways."""

from __future__ import annotations

import openai
import pytest

from pagedserve import LLM
from tests.gateway_stack import running_stack


@pytest.fixture(scope="module")
def stack(zoo, tmp_path_factory):
    with running_stack(tmp_path_factory, zoo.path("llama-gqa"), num_gpu_blocks=1024, max_num_seqs=64) as s:
        yield s


@pytest.fixture(scope="module")
def offline(zoo):
    return LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=512)


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
