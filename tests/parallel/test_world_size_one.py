"""The tensor-parallel code path at one rank: a model loaded through a group of one (gloo on the
CPU, NCCL on CUDA: ``bench/gpu_check.sh`` runs the ``gpu`` case) gives the plain path's logits,
so the sharded load, the all-reduces, the vocabulary gather and the group itself run on every
device we ship for, even where only one GPU is at hand."""

from __future__ import annotations

import pytest
import torch
from torch import distributed as dist

from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.scheduling.plan import ScheduledSeq, StepPlan
from pagedserve.worker.runner.loader import inspect_model
from pagedserve.worker.runner.parallel.group import TIMEOUT, RankGroup
from pagedserve.worker.setup.engine_config import EngineConfig
from pagedserve.worker.setup.runner_build import RunnerBuild

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                  reason="no CUDA device")])]


PROMPT = tuple(range(20, 60))


def row(token_ids: tuple[int, ...], start: int) -> ScheduledSeq:
    """One greedy sequence's row: the prompt's, or a decode after it (blocks 0-2 of 16 tokens)."""
    return ScheduledSeq(seq_id=0, request_id="a", token_ids=token_ids, start=start, block_table=(0, 1, 2), num_samples=1,
                        params=SamplingParams(temperature=0.0), seq_len=start + len(token_ids))


def plain_and_grouped(zoo, name: str, device: torch.device, **engine) -> tuple[RunnerBuild, RunnerBuild, RankGroup]:
    """The model's runner build without a group and through a group of one (and the group)."""
    config = EngineConfig(model=str(zoo.path(name)), device=str(device), dtype="float32", num_gpu_blocks=16, **engine)
    info = inspect_model(config.model, config.dtype)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=TIMEOUT, wait_for_workers=False)
    group = RankGroup(0, 1, store, device)
    return RunnerBuild(config, info, device), RunnerBuild(config, info, device, group=group), group


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-moe"])
def test_one_rank_through_the_parallel_path_gives_the_plain_logits(zoo, device, name):
    *builds, group = plain_and_grouped(zoo, name, torch.device(device))
    plan = StepPlan(seqs=(row(PROMPT, 0),), block_size=16)
    logits = []
    for build in builds:
        with torch.inference_mode():
            logits.append(build.make_runner(16).forward(plan).logits)
    assert group.seconds["all_reduce"] > 0 and group.seconds["all_gather"] > 0  # the collectives ran
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-moe"])
def test_the_graph_forward_through_a_group_of_one_keeps_the_capture_rules(zoo, name):
    """Under tensor parallel the decode graphs hold the layers' all-reduces and the vocabulary gather
    (NCCL inside the graph on CUDA): the graph's forward through a group of one, under what a capture
    forbids (no host data in, no value read back), gives the plain path's logits."""
    from pagedserve.worker.runner.device.cuda_graphs import DecodeGraphs, GraphLimits
    from tests.runner.test_capture_rules import CaptureRules, relax_the_kernels

    device = torch.device("cpu")  # the torch ops, as in tests/runner/test_capture_rules.py (the C stack is the CPU's alone)
    *builds, group = plain_and_grouped(zoo, name, device, attention_backend="torch")
    first, after = row(PROMPT, 0), row((7,), len(PROMPT))
    logits = []
    for build in builds:
        runner = build.make_runner(16)
        with torch.inference_mode():
            runner.forward(StepPlan(seqs=(first,), block_size=16))
            runner.tables.update([after])
            relax_the_kernels(runner.model, runner.ops)
            graphs = DecodeGraphs(runner.model, runner.kv_caches, device, 16, GraphLimits(max_model_len=64, max_num_seqs=2))
            bucket = graphs.bucket(*graphs.key([after]))
            graphs._load(bucket, [after], runner.tables)
            reduced = group.seconds["all_reduce"]
            with CaptureRules():
                logits.append(graphs._forward(bucket, graphs._metadata(bucket))[0])
    assert group.seconds["all_reduce"] > reduced  # the graph's forward summed across the group
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_decode_graphs_with_nccl_inside_give_the_eager_logits(zoo):
    """A group of one on CUDA captures its decode graphs with the NCCL all-reduces and gather inside;
    a decode step replayed from them gives the eager plain path's logits."""
    from pagedserve.worker.runner.device.cuda_graphs import GraphLimits

    plain, grouped, _ = plain_and_grouped(zoo, "llama-gqa", torch.device("cuda"), max_num_seqs=4)
    first, after = row(PROMPT, 0), row((7,), len(PROMPT))
    logits = []
    for build, limits in ((plain, None), (grouped, GraphLimits(64, 4))):
        runner = build.make_runner(16, 0, limits)
        assert (runner.graphs is not None) == (limits is not None)
        with torch.inference_mode():
            runner.forward(StepPlan(seqs=(first,), block_size=16))
            logits.append(runner.forward(StepPlan(seqs=(after,), block_size=16)).logits)
        if limits is not None:
            assert (1, 1, 64) in runner.graphs._buckets  # the decode step replayed the graph of one row
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
