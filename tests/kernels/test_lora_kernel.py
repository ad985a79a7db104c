"""The Triton LoRA update (``paged_kernels/lora_update.py``) against a per-adapter loop and against
the CPU's grouped path (``worker/runner/lora/lora_linear.py``: ``add_updates``): rows of several adapters and of
the base model mixed, ranks padded, widths that are not multiples of the tiles. Under
TRITON_INTERPRET=1 on the CPU, and on CUDA (``gpu`` marker) when a device is present."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_devices import DEVICES  # first: it picks the interpreter on a CPU

pytest.importorskip("triton")

from pagedserve.kernels.lora_update import lora_update  # noqa: E402
from pagedserve.worker.runner.lora.lora_linear import LoraStep, add_updates  # noqa: E402


def per_adapter_loop(y, x, a, b, slots):
    out = y.float().clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[t] += (x[t].float() @ a[slot].float().T) @ b[slot].float().T
    return out


def grouped_step(slots: list[int], device) -> LoraStep:
    """The CPU path's grouping of the same rows (as ``Adapters.prepare`` builds it)."""
    names = sorted({s for s in slots if s >= 0})
    rows = {s: [t for t, slot in enumerate(slots) if slot == s] for s in names}
    width = max(len(r) for r in rows.values())
    gather = [t for s in names for t in rows[s] + rows[s][:1] * (width - len(rows[s]))]
    valid = [n * width + j for n, s in enumerate(names) for j in range(len(rows[s]))]
    index = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
    return LoraStep(index(gather), index(valid), index([t for s in names for t in rows[s]]), len(names), width)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features, out_features, rank", [(64, 96, 8), (200, 130, 16), (96, 300, 5)])
def test_each_row_gets_its_adapters_update(device, dtype, in_features, out_features, rank):
    generator = torch.Generator().manual_seed(in_features + rank)
    rows, adapters = 11, 3
    x = torch.randn(rows, in_features, generator=generator).to(device, dtype)
    y = torch.randn(rows, out_features, generator=generator).to(device, dtype)
    a = (torch.randn(adapters, rank, in_features, generator=generator) * in_features ** -0.5).to(device, dtype)
    b = (torch.randn(adapters, out_features, rank, generator=generator) * 0.1).to(device, dtype)
    slots_list = [0, -1, 2, 2, 1, -1, 0, 2, -1, 1, 0]  # three adapters and base rows, interleaved
    slots = torch.tensor(slots_list, dtype=torch.int32, device=device)
    want = per_adapter_loop(y, x, a, b, slots)
    got = lora_update(y.clone(), x, a, b, slots)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    step = grouped_step(slots_list, device)
    step.weights = {"k": (a, b)}
    torch.testing.assert_close(add_updates(y.clone(), x, "k", step).float(), want, atol=tol * 4, rtol=tol * 4)


@pytest.mark.parametrize("device", DEVICES)
def test_base_rows_and_an_empty_step_are_left_alone(device):
    y = torch.randn(4, 32, device=device)
    x, a, b = torch.randn(4, 16, device=device), torch.randn(1, 8, 16, device=device), torch.randn(1, 32, 8, device=device)
    assert torch.equal(lora_update(y.clone(), x, a, b, torch.full((4,), -1, dtype=torch.int32, device=device)), y)
    assert lora_update(y[:0], x[:0], a, b, torch.empty(0, dtype=torch.int32, device=device)).shape == (0, 32)
    with pytest.raises(ValueError, match="do not fit"):
        lora_update(y, x, a, b[:, :16], torch.zeros(4, dtype=torch.int32, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_the_engine_on_triton_kernels_gives_each_adapter_its_peft_merged_tokens(zoo, tmp_path, device):
    """The whole path with the Triton backend (its attention and this update; interpreted on the
    CPU): two adapters and the base model mixed in one batch, each row equal to transformers + PEFT
    with its adapter merged; on CUDA the decode steps replay graphs reading the adapters' places."""
    from pagedserve import LLM, LoRARequest, SamplingParams
    from tests.lora_helpers import ALL_TARGETS, greedy, make_adapter

    merged = {name: make_adapter(zoo, "llama-gqa", tmp_path / name, rank, targets, seed=seed)
              for seed, (name, rank, targets) in enumerate([("all8", 8, ALL_TARGETS), ("some16", 16, ["q_proj", "down_proj"])])}
    llm = LLM(zoo.path("llama-gqa"), device=device, dtype="float32", num_gpu_blocks=32, enable_lora=True,
              attention_backend="triton")
    assert llm.engine.adapters.step.kernel is lora_update
    assert (llm.engine.runner.graphs is not None) == (device == "cuda")
    prompts = [[10 + i, 20 + 3 * i, 7, 300 + i] * 2 for i in range(3)]
    names = [None, "all8", "some16"]
    requests = [None if n is None else LoRARequest(n, 1, str(tmp_path / n)) for n in names]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), lora_request=requests,
                        use_tqdm=False)
    for prompt, name, out in zip(prompts, names, outs):
        want = zoo.hf_greedy("llama-gqa", prompt, 5) if name is None else greedy(merged[name], prompt, 5)
        assert list(out.outputs[0].token_ids) == want, name
