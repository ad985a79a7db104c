"""The decode graph's forward, on the CPU, under what a CUDA graph capture forbids: no tensor made
from host data (a host-to-device copy inside the graph), no value read back to the host
(``.item()``, ``.tolist()``, ``nonzero``, a tensor's truth). The attention and mixture-of-experts
ops run outside the rule: on CUDA they are the Triton kernels, checked by their own tests; here
they are the torch references, which read lengths back. Every family of the model zoo."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from pagedserve import LLM
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.runner.attention.paged_attention import PagedAttention
from pagedserve.worker.runner.device.cuda_graphs import DecodeGraphs, GraphLimits
from tests.conftest import MODEL_SPECS

aten = torch.ops.aten
# under inference mode (as the graphs run) ``.item()`` arrives as aten.item, not _local_scalar_dense
FORBIDDEN = {aten.lift_fresh.default, aten.lift_fresh_copy.default, aten._local_scalar_dense.default,
             aten.item.default, aten.nonzero.default, aten.is_nonzero.default}


class CaptureRules(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in FORBIDDEN:
            raise AssertionError(f"{func} inside a decode graph: a capture forbids it")
        return func(*args, **(kwargs or {}))


def outside_the_rules(fn):
    def call(*args, **kwargs):
        with _disable_current_modes():
            return fn(*args, **kwargs)
    return call


def relax_the_kernels(model, ops) -> None:
    """``model``'s attention and mixture-of-experts ops run outside the rules (the module's docstring)."""
    relaxed = dataclasses.replace(ops, store_kv=outside_the_rules(ops.store_kv), decode=outside_the_rules(ops.decode),
                                  prefill=outside_the_rules(ops.prefill), moe=outside_the_rules(ops.moe))
    for module in model.modules():
        if isinstance(getattr(module, "attn", None), PagedAttention):
            module.attn.ops = relaxed
        if getattr(module, "ops", None) is ops:  # a mixture-of-experts block
            module.ops = relaxed


def test_the_rules_catch_what_they_name():
    with pytest.raises(AssertionError, match="a capture forbids it"), CaptureRules():
        torch.tensor(2.0) * torch.ones(3)
    with pytest.raises(AssertionError, match="_local_scalar_dense"), CaptureRules():
        torch.ones(3).sum().item()
    with torch.inference_mode():
        values = torch.ones(3)
        with pytest.raises(AssertionError, match="aten.item"), CaptureRules():
            float(values.max())


@pytest.mark.parametrize("family", sorted(MODEL_SPECS))
def test_the_decode_graph_forward_keeps_the_capture_rules(zoo, family):
    llm = LLM(zoo.path(family), device="cpu", dtype="float32", attention_backend="torch", num_gpu_blocks=64,
              block_size=8, max_model_len=64, enforce_eager=True)
    engine = llm.engine
    for i, length in enumerate((5, 12)):
        engine.add_request(str(i), list(range(30 + i, 30 + i + length)), SamplingParams(temperature=0.0, max_tokens=8))
    engine.step()  # the prompts; the next step decodes only
    plan = engine.scheduler.schedule()
    items = sorted(plan.seqs, key=lambda s: s.num_tokens > 1)
    runner = engine.runner
    relax_the_kernels(runner.model, runner.ops)
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.device, 8,
                          GraphLimits(max_model_len=64, max_num_seqs=4, max_draft=2))
    runner.tables.update(items)  # the plan carries only what changed since the prompts' step
    for width in (1, 3):  # decodes, and rows checking two drafts
        bucket = graphs.bucket(4, width, graphs.contexts[-1])
        graphs._load(bucket, items, runner.tables)
        with torch.inference_mode(), CaptureRules():
            logits = graphs._forward(bucket, graphs._metadata(bucket))
        assert logits.shape[0] == 4 * width


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemmas_embedding_scale_is_the_dtypes_own_rounding(dtype):
    from pagedserve.worker.runner.models.gemma import rounded_to

    for hidden in (576, 640, 2304, 3072, 3584, 1152, 1000):
        assert rounded_to(hidden**0.5, dtype) == torch.tensor(hidden**0.5, dtype=dtype).item()
