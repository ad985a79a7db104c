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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-moe"])
def test_one_rank_through_the_parallel_path_gives_the_plain_logits(zoo, device, name):
    device = torch.device(device)
    config = EngineConfig(model=str(zoo.path(name)), device=str(device), dtype="float32", num_gpu_blocks=16)
    info = inspect_model(config.model, config.dtype)
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=TIMEOUT, wait_for_workers=False)
    group = RankGroup(0, 1, store, device)
    prompt = tuple(range(20, 60))
    seq = ScheduledSeq(seq_id=0, request_id="a", token_ids=prompt, start=0, block_table=(0, 1, 2), num_samples=1,
                       params=SamplingParams(temperature=0.0), seq_len=len(prompt))
    plan = StepPlan(seqs=(seq,), block_size=16)
    logits = []
    for build in (RunnerBuild(config, info, device), RunnerBuild(config, info, device, group=group)):
        with torch.inference_mode():
            logits.append(build.make_runner(16).forward(plan).logits)
    assert group.seconds["all_reduce"] > 0 and group.seconds["all_gather"] > 0  # the collectives ran
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)
