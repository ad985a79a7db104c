"""A broken device ends the engine instead of failing every later step: a CUDA error (illegal
address, device-side assert, torch's AcceleratorError) raises ``DeviceFailure`` with the requests
left as they were (pending, for another worker to resume); out of memory and ordinary failures
fail that step's requests and the engine steps on (tests/engine/test_engine.py). ``--device cuda:N`` makes N current around
loading and every step (Triton launches and graph capture use the current device)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.runner.device import failures as device_errors
from pagedserve.worker.runner.device.failures import DeviceFailure, device_guard, is_device_failure


class AcceleratorError(RuntimeError):  # torch's type of that name, where this torch has none
    pass


@pytest.mark.parametrize("err,sticky", [
    (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
    (RuntimeError("CUDA error: device-side assert triggered"), True),
    (AcceleratorError("whatever it says"), True),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
    (ValueError("a bug"), False),
    (RuntimeError("shape mismatch"), False),
])
def test_which_errors_are_the_devices(err, sticky):
    assert is_device_failure(err) is sticky


def engine_failing_with(zoo, err: BaseException):
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=64)
    engine = llm.engine
    launch = engine.runner.launch
    failures = [err]

    def broken_once(plan, previous=None):
        if failures:
            raise failures.pop()
        return launch(plan, previous)

    engine.runner.launch = broken_once
    engine.add_request("a", list(range(20, 30)), SamplingParams(temperature=0.0, max_tokens=4))
    return engine


def test_a_device_failure_ends_the_engine_and_fails_nothing(zoo):
    engine = engine_failing_with(zoo, RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(DeviceFailure, match="the device failed: RuntimeError: CUDA error: an illegal memory access"):
        engine.step()
    assert engine.has_unfinished()  # not failed: its stream resumes elsewhere


def test_cuda_n_is_made_current_around_loading_and_steps(zoo, monkeypatch):
    entered = []

    @contextlib.contextmanager
    def recording(device):
        entered.append(str(device))
        yield

    monkeypatch.setattr(device_errors.torch.cuda, "device", recording)
    with device_guard(torch.device("cuda:1")):
        pass
    with device_guard(torch.device("cpu")):
        pass
    assert entered == ["cuda:1"]
    import pagedserve.worker.engine as engine_module
    import pagedserve.worker.step_loop as step_loop_module

    guarded = []
    for module in (engine_module, step_loop_module):  # loading; each step's launch and read
        monkeypatch.setattr(module, "device_guard", lambda device: guarded.append(str(device)) or contextlib.nullcontext())
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=64)
    llm.generate([list(range(20, 26))], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
    assert guarded[0] == "cpu" and len(guarded) >= 3  # loading, then every step
