"""The engine thread's side of the KV dashboard: a snapshot is taken between steps when asked, and
a snapshot that fails costs that picture, never the engine."""

from __future__ import annotations

from pagedserve.shared.protocol import ReplyTarget, WireRequest
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.engine import Engine
from pagedserve.worker.serve.loop import EngineLoop
from pagedserve.worker.setup.engine_config import EngineConfig


def request(request_id: str) -> WireRequest:
    return WireRequest(request_id, "tiny", SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
                       ReplyTarget("channel", "pagedserve:replies:test"))


def test_a_failing_snapshot_costs_the_picture_not_the_engine(zoo, monkeypatch):
    engine = Engine(EngineConfig(model=str(zoo.path("llama-gqa")), device="cpu", dtype="float32", num_gpu_blocks=64))
    finished, pictures = [], []
    loop = EngineLoop(engine, lambda outs, errors: finished.extend(o.request_id for o in outs if o.finished),
                      on_picture=pictures.append)

    def broken():
        raise RuntimeError("a bug in the snapshot")

    # The fault is patched in: no input makes the real snapshot raise, which is the point of the guard.
    monkeypatch.setattr(engine, "kv_snapshot", broken)
    loop.want_picture()
    loop.add(request("a"), [5, 6, 7])
    loop.finish()
    loop.run()
    assert finished == ["a"] and pictures == []

    monkeypatch.undo()
    loop.want_picture()
    loop.run()  # finished and idle: takes the picture asked for, then returns
    assert len(pictures) == 1 and pictures[0]["figures"]["total"] == 64 and pictures[0]["took_ms"] >= 0
