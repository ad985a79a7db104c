"""Whatever lands on the request stream, the worker stays up: each arbitrary entry is followed by a
valid canary, and every canary is served while every bad entry is dead-lettered or answered."""

from __future__ import annotations

import asyncio
from dataclasses import fields

import msgpack
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings, strategies as st

from pagedserve.runtime.client import QueueClient
from pagedserve.shared.keys import Keys
from pagedserve.shared.protocol import VERSION
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.engine import Engine
from pagedserve.worker.setup.engine_config import EngineConfig
from tests.conftest import examples
from tests.service_helpers import MODEL_NAME, apoll, collect, running_worker, settings_for

KEYS = Keys()
LEAVES = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
          | st.binary(max_size=8))
VALUES = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=6) | st.integers(0, 3), inner, max_size=3), max_leaves=8)
FIELDS = ["v", "id", "model", "prompt", "prompt_token_ids", "messages", "params", "reply", "created", "deadline",
          "priority", "tenant"]


def valid(request_id: str, channel: str) -> dict:
    return {"v": VERSION, "id": request_id, "model": MODEL_NAME, "prompt_token_ids": [5, 6, 7],
            "params": {"max_tokens": 2, "temperature": 0.0}, "reply": {"channel": channel}}


PARAM_NAMES = [f.name for f in fields(SamplingParams)]
PARAMS = st.dictionaries(st.sampled_from(PARAM_NAMES) | st.integers(0, 3), VALUES, min_size=1, max_size=2)
ENTRIES = st.one_of(
    VALUES.map(lambda v: msgpack.packb(v, use_bin_type=True)),  # anything at all
    st.binary(max_size=40),  # not even msgpack
    st.tuples(st.sampled_from(FIELDS), VALUES).map(lambda fv: ("mutate",) + fv),  # a valid request, one field changed
    PARAMS.map(lambda p: ("mutate", "params", p)),  # valid but for its sampling parameters
)


@pytest.fixture(scope="module")
def engine(zoo):
    return Engine(EngineConfig(model=str(zoo.path("llama-gqa")), device="cpu", dtype="float32", num_gpu_blocks=256))


def test_arbitrary_entries_never_stop_the_worker(redis_server, zoo, engine):
    async def main():
        r = aioredis.from_url(redis_server.url)
        async with running_worker(settings_for(redis_server.url, zoo.path("llama-gqa")), engine) as service:
            async with QueueClient(redis_server.url) as client:
                counter = iter(range(10**6))

                @settings(max_examples=examples(60), deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
                @given(entry=ENTRIES)
                def one(entry):
                    i = next(counter)
                    if isinstance(entry, tuple):
                        _, field, value = entry
                        entry = msgpack.packb({**valid(f"bad-{i}", client.dispatcher.channel), field: value},
                                              use_bin_type=True)
                    asyncio.run_coroutine_threadsafe(r.xadd(KEYS.requests(MODEL_NAME), {"data": entry}), loop).result(10)
                    canary = asyncio.run_coroutine_threadsafe(
                        collect_canary(client, f"canary-{i}"), loop).result(60)
                    assert canary.last.done and canary.last.finish_reason == "length", canary.last

                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, one)
                await apoll(lambda: not service.inflight, 30, "every answered bad entry to finish")
            pending = await r.xpending(KEYS.requests(MODEL_NAME), KEYS.group(MODEL_NAME))
        await r.aclose()
        return pending

    assert asyncio.run(main())["pending"] == 0


async def collect_canary(client: QueueClient, request_id: str):
    stream = await client.submit(MODEL_NAME, prompt_token_ids=[9, 10, 11], request_id=request_id,
                                 params=SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    return await collect(stream)
