"""EngineConfig: the engine's settings, frozen and validated once, and the KV pool sizing rule."""

from __future__ import annotations

import os
from dataclasses import dataclass

from worker.core.config import PreemptionMode

CPU_KV_FRACTION = 0.25  # of available RAM, when no budget is given on a CPU
CPU_KV_CAP = 1 << 30


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"
    device: str | None = None  # "cuda" when available, else "cpu"
    attention_backend: str = "auto"  # "auto" (Triton on CUDA, native C kernels on the CPU), "torch", "native", "triton"
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes for the KV pool
    num_gpu_blocks: int | None = None  # exact pool size (overrides kv_cache_memory)
    swap_space: int = 1 << 30  # bytes of CPU pool for preemption_mode="swap"
    num_cpu_blocks: int | None = None  # exact CPU pool size (overrides swap_space)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's
    enable_prefix_caching: bool = True
    preemption_mode: PreemptionMode = "recompute"
    seed: int = 0
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    gpu_memory_utilization: float = 0.9  # share of the device's memory this engine may fill (weights, KV, steps)
    generation_config: str = "auto"  # "auto": the model's generation_config.json gives the default SamplingParams; "vllm": not
    simulate: str | None = None  # "BASE,PER_SEQ,PER_TOKEN" seconds: no model, steps sleep that long (worker/runner/simulated.py)

    def __post_init__(self) -> None:
        for name in ("kv_cache_memory", "num_gpu_blocks", "num_cpu_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not isinstance(self.swap_space, int) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a number of bytes >= 0, got {self.swap_space!r}")

    @property
    def sizes_pool_from_memory(self) -> bool:
        return self.num_gpu_blocks is None and self.kv_cache_memory is None

    def gpu_blocks(self, block_bytes: int, free_bytes: int, on_cuda: bool, total_bytes: int = 0,
                   step_peak_bytes: int = 0) -> int:
        """Pool size from the exact count, the byte budget, or what memory leaves: on CUDA
        ``gpu_memory_utilization * total - in use now (weights, context) - one step's peak``; on a
        CPU a quarter of the available RAM, at most 1 GiB."""
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        budget = self.kv_cache_memory
        if budget is None and on_cuda:
            budget = int(self.gpu_memory_utilization * total_bytes) - (total_bytes - free_bytes) - step_peak_bytes
        elif budget is None:
            budget = min(int(free_bytes * CPU_KV_FRACTION), CPU_KV_CAP)
        blocks = budget // block_bytes
        if blocks < 1:
            raise ValueError(f"a KV budget of {budget} bytes holds no block of {block_bytes} bytes; raise "
                             "gpu_memory_utilization or lower max_num_batched_tokens / max_num_seqs")
        return blocks

    def cpu_blocks(self, block_bytes: int) -> int:
        if self.num_cpu_blocks is not None:
            return self.num_cpu_blocks
        return self.swap_space // block_bytes if self.preemption_mode == "swap" else 0


def available_ram() -> int:
    """Bytes of memory available to a new allocation on this host."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
