"""What makes the engine's ``ModelRunner``: the model loaded with its ops and KV format, the key
turns of a quantized cache calibrated, the pool sized, the runner made. Under tensor parallel every
rank holds a ``RunnerBuild`` over its slice of the model (``worker/runner/parallel/``) and makes the same
calls in the same order (rank 0 announces each, ``build_runner``), so the collectives inside meet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from typing import Callable

import structlog
import torch
from tqdm.auto import tqdm

from pagedserve.kernels.kv_format import kv_format
from pagedserve.kernels.ops import select_ops
from pagedserve.runtime.env import cache_dir
from pagedserve.worker.core.kv_cache.kv_layout import KvLayout
from pagedserve.worker.runner.attention.key_rotation import calibrate
from pagedserve.worker.runner.device.cuda_graphs import GraphLimits, graph_pool_bytes
from pagedserve.worker.runner.device.memory_profile import peak_step_bytes, reserved_beside_pool
from pagedserve.worker.runner.loader import ModelInfo, inspect_model, load_weights
from pagedserve.worker.runner.lora.adapters import Adapters
from pagedserve.worker.runner.lora.graph_stack import stack_bytes
from pagedserve.worker.runner.model_runner import ModelRunner, kv_block_bytes
from pagedserve.worker.runner.models.layers import CausalLM, kv_layout
from pagedserve.worker.runner.parallel.group import RankFailure, RankGroup
from pagedserve.worker.runner.parallel.parallelize import parallelize
from pagedserve.worker.runner.parallel.shard import Shard
from pagedserve.worker.runner.sampling.beam_search import BeamSearcher
from pagedserve.worker.runner.sampling.sampler import Sampler
from pagedserve.worker.setup.engine_config import EngineConfig, available_ram
from pagedserve.worker.setup.ranks import Ranks

log = structlog.get_logger("pagedserve.engine")


@dataclass(frozen=True)
class BuiltRunner:
    runner: ModelRunner
    ranks: Ranks | None  # the other tensor-parallel ranks, started
    adapters: Adapters | None
    block_bytes: int  # one block's K/V bytes over all ranks
    num_gpu: int  # the pool's blocks
    num_cpu: int  # the swap pool's


def build_runner(config: EngineConfig, info: ModelInfo, device: torch.device, eos: frozenset[int], max_len: int,
                 calibration_ids: Callable[[int], list[int]]) -> BuiltRunner:
    """Load the model, size the pool and make the runner; under tensor parallel the other ranks are
    started first (a model that cannot be split is refused before) and every call is announced to
    them. ``calibration_ids(max_len)``: the calibration text's ids (a quantized cache's key turns)."""
    ranks = None
    if config.tensor_parallel_size > 1:
        Shard(0, config.tensor_parallel_size).check(info.config)
        ranks = Ranks.start(config, device)
    try:
        return _build_on_ranks(config, info, device, eos, max_len, calibration_ids, ranks)
    except RankFailure as err:
        why = ranks.explain(err)
        ranks.close()
        raise RankFailure(f"a tensor-parallel rank failed while the engine started: {why} (its log says why)") from err
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise


def _build_on_ranks(config: EngineConfig, info: ModelInfo, device: torch.device, eos: frozenset[int], max_len: int,
                    calibration_ids: Callable[[int], list[int]], ranks: Ranks | None) -> BuiltRunner:
    build = RunnerBuild(config, info, device, eos, ranks.group if ranks else None)
    every_rank = build if ranks is None else ranks.mirror(build)
    adapters = every_rank.load_adapters()
    build.load_draft()
    if build.kv.quantized:  # before the pool is sized: its runner comes and goes first
        every_rank.calibrate(calibration_ids(max_len))
    graphs = not config.enforce_eager and build.ops.backend == "triton"  # captured only then (model_runner.py)
    num_gpu = every_rank.pool_blocks(max_len, graphs)
    num_cpu = config.cpu_blocks(build.block_bytes)
    runner = every_rank.make_runner(num_gpu, num_cpu, None if config.enforce_eager else build.graph_limits(max_len))
    if ranks is not None:
        runner.announce = ranks.announce_step
    if device.type == "cuda" and build.ops.backend == "triton":
        (runner if ranks is None else ranks.mirror(runner)).warm_decode(max_len)
    # over all ranks: every rank's part of the model's bytes, and the draft model's on rank 0 alone
    block_bytes = build.block_bytes + (config.tensor_parallel_size - 1) * build.model_block_bytes
    return BuiltRunner(runner, ranks, adapters, block_bytes, num_gpu, num_cpu)


class RunnerBuild:
    def __init__(self, config: EngineConfig, info: ModelInfo, device: torch.device, eos: frozenset[int] = frozenset(),
                 group: RankGroup | None = None) -> None:
        self.config, self.info, self.device, self.eos, self.group = config, info, device, eos, group
        self.kv = kv_format(config.kv_cache_dtype, device, config.quantized_products)
        self.ops = select_ops(device, config.attention_backend, cache_dir() / "kernels", self.kv)
        self.shard = None if group is None else Shard(group.rank, group.size)  # this rank's part of each tensor
        self.model = load_weights(info, self.ops, device, config.quantization, self.shard, config.gguf_activations)
        self.model.kv_layout = kv_layout(info.config, config.hybrid_kv_cache)
        if group is not None:
            parallelize(self.model, group, info.config.vocab_size)
        self.draft: CausalLM | None = None  # speculative decoding's draft model (load_draft; rank 0's alone under TP)
        self.draft_config = None  # its config (its decode graphs' pool is sized from it)
        self.adapters: Adapters | None = None  # LoRA (load_adapters)

    def load_adapters(self) -> Adapters | None:
        """LoRA adapters over the model (``--enable-lora``), those of ``--lora-modules`` read now (a
        rank's part of each under tensor parallel); kept for the runner (None without LoRA)."""
        config = self.config
        if config.enable_lora:
            cut = None if self.shard is None else partial(self.shard.lora_piece, config=self.info.config)
            self.adapters = Adapters(self.model, config.max_loras, config.max_lora_rank, self.device, self.info.dtype,
                                     self.ops.lora, cut)
            for name, path in config.lora_adapters.items():
                self.adapters.load(name, path)
        return self.adapters

    def load_draft(self) -> CausalLM | None:
        """Speculative decoding's draft model (``{"model": ...}``), at the target's dtype, with its
        own weight quantization; kept for the runner (None without one). Its vocabulary must be the
        target's."""
        spec = self.config.speculative
        if spec is None or spec.model is None:
            return None
        try:
            draft_info = inspect_model(spec.model, self.info.dtype)
        except ValueError as err:  # not found, not a model, an unsupported family: say it is the draft
            raise type(err)(f"the speculative draft model: {err}") from err
        vocab = self.info.config.vocab_size
        if draft_info.config.vocab_size != vocab:
            raise ValueError(f"the speculative draft model {spec.model} has a vocabulary of {draft_info.config.vocab_size} "
                             f"tokens; the model's has {vocab}: a draft must share its tokenizer")
        with tqdm(total=1, desc="loading the draft model", unit="model", leave=False, disable=None):
            self.draft = load_weights(draft_info, self.ops, self.device, spec.quantization)
        self.draft_config = draft_info.config
        # its KV on the target's first lane's blocks, a full lane: one lane of its own, every position kept
        self.draft.kv_layout = KvLayout.uniform(len(self.draft.model.layers))
        return self.draft

    @property
    def model_block_bytes(self) -> int:
        """One block's K/V bytes of this rank's part of the model."""
        return kv_block_bytes(self.model, self.config.block_size, self.info.dtype, self.kv)

    @property
    def block_bytes(self) -> int:
        """One block's K/V bytes on this rank, the draft model's included."""
        draft = 0 if self.draft is None else kv_block_bytes(self.draft, self.config.block_size, self.info.dtype, self.kv)
        return self.model_block_bytes + draft

    def graph_limits(self, max_len: int) -> GraphLimits:
        """What the decode graphs are captured for: lengths, rows, and the most drafts a row checks."""
        spec = self.config.speculative
        return GraphLimits(max_len, self.config.max_num_seqs, spec.num_speculative_tokens if spec is not None else 0)

    def make_runner(self, num_gpu: int, num_cpu: int = 0, graphs: GraphLimits | None = None) -> ModelRunner:
        config = self.config
        eager_lora = self.adapters is not None and self.adapters.step.kernel is None  # the graphs need the per-token kernel
        # under tensor parallel every rank captures and replays the same graphs, its collectives inside them
        graphs = None if eager_lora else graphs
        return ModelRunner(self.model, self.ops, self.device, self.info.dtype, self.kv, config.block_size, num_gpu,
                           num_cpu, Sampler(self.eos, seed=config.seed, device=self.device), BeamSearcher(self.eos),
                           graphs, self.draft, self.adapters)

    def calibrate(self, ids: list[int]) -> None:
        """A quantized cache's key turns, fitted on the shipped calibration text (worker/runner/attention/key_rotation.py)
        with a runner of its own whose pool holds just that text, and dropped after."""
        started = time.perf_counter()
        with tqdm(total=1, desc="calibrating the KV cache's key turns", unit="pass", leave=False, disable=None):
            calibrate(self.make_runner(-(-len(ids) // self.config.block_size) * self.model.kv_layout.num_lanes), ids)
        log.info("kv cache key turns calibrated", tokens=len(ids), seconds=round(time.perf_counter() - started, 2))

    def pool_blocks(self, max_len: int, graphs: bool) -> int:
        """KV blocks for the pool (the fewest any rank can hold); on CUDA what is left after the
        weights, one worst-case step and the decode graphs' pool (``memory_profile.reserved_beside_pool``)."""
        blocks = self._local_pool_blocks(max_len, graphs)
        return blocks if self.group is None else self.group.min_int(blocks)

    def _local_pool_blocks(self, max_len: int, graphs: bool) -> int:
        config, model_config, device = self.config, self.info.config, self.device
        if device.type != "cuda":
            return config.gpu_blocks(self.block_bytes, available_ram(), False)
        reserved = 0
        if config.sizes_pool_from_memory:
            peak = peak_step_bytes(self.make_runner, config.block_size, config.max_num_batched_tokens,
                                   config.max_num_seqs, max_len, model_config.vocab_size, device,
                                   self.model.kv_layout.num_lanes)
            dtype_bytes = torch.empty((), dtype=self.info.dtype, device="meta").element_size()
            reserved = reserved_beside_pool(peak, model_config, self.graph_limits(max_len), dtype_bytes, graphs)
            if graphs and self.draft is not None:  # the draft model's rounds replay graphs of their own
                reserved += graph_pool_bytes(self.graph_limits(max_len), self.draft_config, dtype_bytes)
            if graphs and self.adapters is not None and self.adapters.step.kernel is not None:
                reserved += stack_bytes(self.adapters)  # the adapters' places the graphs read
        free, total = torch.cuda.mem_get_info(device)
        blocks = config.gpu_blocks(self.block_bytes, free, True, total, reserved)
        log.info("gpu memory", total_gib=round(total / 2**30, 2), in_use_gib=round((total - free) / 2**30, 2),
                 reserved_beside_pool_gib=round(reserved / 2**30, 3), utilization=config.gpu_memory_utilization,
                 kv_gib=round(blocks * self.block_bytes / 2**30, 2))
        return blocks
