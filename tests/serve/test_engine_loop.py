"""``worker/serve/loop.py`` on its own: the engine's thread, with the real engine on a small model and
no Redis. What the service puts in its inbox (requests with every wire field, aborts, KV resyncs,
dashboard pictures) reaches the engine; what comes out (outputs, refusals, prefix-cache hashes,
stats snapshots) reaches its callbacks; ``finish`` ends ``run`` once the work is done, and an idle
loop wakes for new work."""

from __future__ import annotations

import threading
import time

import pytest

from pagedserve.shared.protocol import ReplyTarget, Resume, WireRequest
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.engine import Engine
from pagedserve.worker.serve.loop import EngineLoop
from pagedserve.worker.setup.engine_config import EngineConfig
from tests.service_helpers import poll

PROMPT = list(range(20, 40))  # two full blocks of 8


@pytest.fixture(scope="module")
def engine(zoo):
    """One sequence at a time, so the order requests run in shows their priority."""
    return Engine(EngineConfig(model=str(zoo.path("llama-gqa")), device="cpu", dtype="float32", num_gpu_blocks=64,
                               block_size=8, max_model_len=128, max_num_seqs=1))


@pytest.fixture
def fresh(engine):
    engine.forget_cached()
    yield engine
    assert not engine.has_unfinished()


def request(request_id: str, max_tokens: int = 4, **fields) -> WireRequest:
    return WireRequest(request_id, "m", SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                       ReplyTarget("channel", "pagedserve:replies:test"), **fields)


class Received:
    """What ``on_outputs`` was handed: every output in order, each refusal, and the calls themselves."""

    def __init__(self) -> None:
        self.outputs, self.errors, self.calls = [], [], 0

    def __call__(self, outputs, errors) -> None:
        assert outputs or errors, "a call with nothing in it"
        self.calls += 1
        self.outputs.extend(outputs)
        self.errors.extend(errors)

    def tokens(self, request_id: str) -> list[int]:
        last = [o for o in self.outputs if o.request_id == request_id][-1]
        assert last.finished
        return list(last.outputs[0].token_ids)

    def finished_order(self) -> list[str]:
        return [o.request_id for o in self.outputs if o.finished]


def run_all(loop: EngineLoop, *work: tuple[WireRequest, list[int]]) -> None:
    for req, ids in work:
        loop.add(req, ids)
    loop.finish()
    loop.run()


def test_requests_run_to_the_end_as_the_model_says_and_every_call_carries_something(fresh, zoo):
    received = Received()
    loop = EngineLoop(fresh, received)
    run_all(loop, (request("a", 5), PROMPT), (request("b", 3), PROMPT[:7]))
    assert received.tokens("a") == zoo.hf_greedy("llama-gqa", PROMPT, 5)
    assert received.tokens("b") == zoo.hf_greedy("llama-gqa", PROMPT[:7], 3)
    assert received.errors == [] and all(o.outputs for o in received.outputs)


def test_every_wire_field_reaches_the_engine(fresh, zoo):
    """Priority orders the queue, a past deadline ends a request at once, a resume goes on from the
    tokens its client holds, a tenant's blocks hash apart from everyone else's."""
    received = Received()
    loop = EngineLoop(fresh, received)
    greedy = zoo.hf_greedy("llama-gqa", PROMPT, 4)
    run_all(loop, (request("later", 2, priority=1), PROMPT), (request("first", 2, priority=0), PROMPT[:9]),
            (request("expired", 4, deadline=time.time() - 1), PROMPT[:5]))
    assert received.finished_order() == ["expired", "first", "later"]
    assert received.tokens("expired") == []

    resumed = [(greedy[0] + 1) % 512, (greedy[1] + 1) % 512]  # not what greedy says: only a resume keeps them
    run_all(loop, (request("resumed", 4, resume=Resume(resumed, 3)), PROMPT))
    out = received.tokens("resumed")
    assert out[:2] == resumed and len(out) == 4
    assert out[2:] == zoo.hf_greedy("llama-gqa", PROMPT + resumed, 2)

    before = len(fresh.cached_hashes())
    run_all(loop, (request("tenant", 1, tenant="acme"), PROMPT))
    assert len(fresh.cached_hashes()) == before + 2  # the same two blocks, under the tenant's own hashes


def test_a_request_the_engine_refuses_is_reported_and_the_others_go_on(fresh):
    received = Received()
    loop = EngineLoop(fresh, received)
    run_all(loop, (request("long", 4), list(range(200))), (request("ok", 2), PROMPT),
            (request("bad resume", 4, resume=Resume([10**6], 1)), PROMPT))
    assert received.errors == [
        ("long", "prompt (200 tokens) + max_tokens (4) exceeds the model's maximum length of 128 tokens"),
        ("bad resume", "resume token ids must be integers in [0, 512)"),
    ]
    assert received.finished_order() == ["ok"]


def test_refusals_alone_still_reach_the_callback(fresh):
    received = Received()
    run_all(EngineLoop(fresh, received), (request("long", 4), list(range(200))))
    assert received.calls == 1 and received.outputs == [] and [e[0] for e in received.errors] == ["long"]


def test_an_abort_ends_a_running_request_and_frees_its_blocks(fresh):
    """The abort is sent from the first output's callback (the engine's thread, as the service's
    would be from its own): however fast the model, the request is still running when it lands."""
    loop = EngineLoop(fresh, lambda outputs, errors: (received(outputs, errors), loop.abort("long")))
    received = Received()
    loop.add(request("long", 100), PROMPT)
    loop.finish()
    loop.run()
    assert len(received.outputs[-1].outputs[0].token_ids) < 100
    assert received.outputs[-1].finished
    assert fresh.stats()["kv_cache_usage_perc"] == 0.0


def test_an_idle_loop_waits_for_work_and_finish_returns_once_it_is_done(fresh):
    received = Received()
    loop = EngineLoop(fresh, received)
    thread = threading.Thread(target=loop.run)
    thread.start()
    try:
        time.sleep(0.7)  # past the idle wait's first timeout: the loop must still be there
        assert thread.is_alive()
        loop.add(request("a", 2), PROMPT)
        poll(lambda: received.finished_order() == ["a"] or not thread.is_alive(), 30, "the idle loop to take the request")
        assert thread.is_alive()  # done, but not told to finish
    finally:
        loop.finish()
        thread.join(30)
    assert not thread.is_alive()


def test_the_inbox_counts_what_waits_for_the_engine(fresh):
    loop = EngineLoop(fresh, Received())
    loop.add(request("a", 1), PROMPT)
    loop.abort("a")
    assert loop.queued == 2
    loop.finish()
    loop.run()
    assert loop.queued == 0


def test_prefix_cache_hashes_are_sent_as_they_change_and_all_of_them_on_a_resync(fresh):
    sent = []
    loop = EngineLoop(fresh, Received(), on_kv=lambda changes: sent.append((list(changes.published), list(changes.dropped), changes.reset)))
    run_all(loop, (request("a", 1), PROMPT))
    loop.run()  # the blocks were published by the last step: the next pass sends them
    assert len(sent) == 1 and len(sent[0][0]) == 2 and sent[0][1:] == ([], False)
    run_all(loop, (request("b", 1), PROMPT))  # the same blocks: nothing new to say
    loop.run()
    assert len(sent) == 1
    loop.resync_kv()
    loop.run()
    assert sent[1] == (fresh.cached_hashes(), [], True) and sorted(sent[1][0]) == sorted(sent[0][0])


def test_without_a_kv_reader_no_hashes_are_kept(fresh):
    loop = EngineLoop(fresh, Received())
    assert loop.kv_events is None
    run_all(loop, (request("a", 1), PROMPT))


def test_a_picture_asked_for_is_taken_between_steps_with_its_time(fresh):
    pictures = []
    loop = EngineLoop(fresh, Received(), on_picture=pictures.append)
    loop.want_picture()
    run_all(loop, (request("a", 2), PROMPT))
    assert len(pictures) == 1 and pictures[0]["figures"]["total"] == 64 and pictures[0]["took_ms"] >= 0
    loop.run()
    assert len(pictures) == 1  # asked for once, taken once


def test_the_stats_snapshot_follows_the_engine_at_its_pace_and_when_it_goes_idle(fresh):
    seen = []
    loop = EngineLoop(fresh, lambda outputs, errors: seen.append(loop.snapshot["num_requests_running"]),
                      snapshot_every_s=3600)
    assert loop.snapshot == fresh.stats()
    run_all(loop, (request("a", 3), PROMPT))
    assert seen == [0, 0, 0]  # not due while the request ran (it was taken before the request came)
    assert loop.snapshot == fresh.stats() and loop.snapshot["prefix_cache_queries_total"] > 0  # idle: taken at once

    seen.clear()
    loop = EngineLoop(fresh, lambda outputs, errors: seen.append(loop.snapshot["num_requests_running"]), snapshot_every_s=0)
    run_all(loop, (request("b", 3), PROMPT[:5]))
    assert seen == [0, 1, 1]  # every step's own, read by the next step's callback


def test_a_pictures_time_is_what_taking_it_took_and_a_failing_one_is_logged_not_sent(fresh, monkeypatch):
    from structlog.testing import capture_logs

    pictures = []
    loop = EngineLoop(fresh, Received(), on_picture=pictures.append)
    real = fresh.kv_snapshot

    def slow():
        time.sleep(0.05)
        return real()

    monkeypatch.setattr(fresh, "kv_snapshot", slow)
    loop.want_picture()
    loop.finish()
    loop.run()
    took = pictures[0]["took_ms"]
    assert isinstance(took, float) and took == round(took, 2) and took >= 50  # milliseconds: the 50 ms it slept at least

    def broken():
        raise RuntimeError("a bug in the snapshot")

    monkeypatch.setattr(fresh, "kv_snapshot", broken)
    loop.want_picture()
    with capture_logs() as logs:
        loop.run()
    assert len(pictures) == 1
    assert [(e["event"], e["log_level"]) for e in logs] == [("dashboard snapshot failed", "error")]
