"""Frozen, validated configuration of the scheduler and KV cache (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from pagedserve.shared.block_hash import cache_salt
from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.kv_cache.block_pool import BLOCK_SIZE
from pagedserve.worker.core.kv_cache.kv_layout import blocks_held
from pagedserve.worker.core.speculative.config import SpeculativeConfig

PreemptionMode = Literal["recompute", "swap"]
PREEMPTION_MODES: tuple[str, ...] = get_args(PreemptionMode)


@dataclass(frozen=True)
class SchedulerConfig:
    num_gpu_blocks: int
    block_size: int = BLOCK_SIZE
    num_cpu_blocks: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    preemption_mode: PreemptionMode = "recompute"
    lane_windows: tuple[int, ...] = (0,)  # each lane's window (0: full), worker/core/kv_cache/kv_layout.py
    rope_switch: int = 0  # > 0 (long-rope): a sequence growing past this length has its KV recomputed
    speculative: SpeculativeConfig | None = None  # prompt-lookup drafts, checked in one forward (worker/core/speculative/config.py)
    max_loras: int = 0  # LoRA adapters among the running requests at most (0: no limit; worker/runner/lora/)
    max_step_ms: float | None = None  # a step with decoding rows stays about within this (step_time.py); None: off

    def __post_init__(self) -> None:
        positive = ("num_gpu_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.num_cpu_blocks, bool) or not isinstance(self.num_cpu_blocks, int) or self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be an integer >= 0, got {self.num_cpu_blocks!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.max_step_ms is not None and not (isinstance(self.max_step_ms, (int, float)) and self.max_step_ms > 0):
            raise ValueError(f"max_step_ms must be a number of milliseconds > 0, got {self.max_step_ms!r}")
        if not self.lane_windows or any(not isinstance(w, int) or w < 0 for w in self.lane_windows):
            raise ValueError(f"lane_windows must be one window >= 0 per lane, got {self.lane_windows!r}")

    @property
    def sliding_window(self) -> int:
        """W when every lane slides (the widest window), else 0."""
        return max(self.lane_windows) if all(self.lane_windows) else 0

    def prefix_key(self, extra_key, num_tokens: int):
        """A prefix-cache block's salt: the request's, and under long-rope which factors its KV
        was rotated with (short up to ``rope_switch`` tokens, long past it)."""
        return cache_salt(extra_key, num_tokens, self.rope_switch)

    def check_fits(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise InvalidRequestError for a request this configuration could never serve."""
        if prompt_len == 0:
            raise InvalidRequestError("the prompt is empty", "prompt")
        if prompt_len + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"maximum length of {self.max_model_len} tokens", "max_tokens",
            )
        if params.num_seqs > self.max_num_seqs:
            raise InvalidRequestError(f"{params.num_seqs} sequences (n, best_of or beam_width) exceed "
                                      f"max_num_seqs={self.max_num_seqs}", "n")
        # Worst case: every output sequence recomputed privately after a preemption; a sliding lane
        # holds at most its window plus one prefill chunk, and a partial block.
        worst = params.num_seqs * blocks_held(self.lane_windows, prompt_len + params.max_tokens, self.block_size,
                                              self.max_num_batched_tokens)
        if worst > self.num_gpu_blocks:
            raise InvalidRequestError(
                f"the request needs up to {worst} KV blocks but the cache holds {self.num_gpu_blocks}; "
                "lower max_tokens or n", "max_tokens",
            )
