"""The gateway tests' stack: a real redis-server, an in-process worker with the real engine, gateways."""

from __future__ import annotations

import openai
import pytest

from pagedserve import LLM
from pagedserve.embedded_redis import RedisServer
from pagedserve.worker.engine import Engine
from pagedserve.worker.engine_config import EngineConfig
from tests.gateway_stack import Stack


@pytest.fixture(scope="module")
def stack(zoo, tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    engine = Engine(EngineConfig(model=str(zoo.path("llama-gqa")), device="cpu", dtype="float32", num_gpu_blocks=1024, max_num_seqs=64))
    try:
        s = Stack(server, engine, zoo.path("llama-gqa")).start()
        yield s
        s.stop()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def offline(zoo):
    return LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=512)


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=60)
