"""EngineConfig: the engine's settings, frozen and validated once, and the KV pool sizing rule.

Each setting a user may pass on a command line is declared here once, with its help text and the
type that checks it (``flag``): ``worker/setup/engine_flags.py`` makes the CLI options, their
environment variables and the argv ``serve`` hands to its workers from these declarations.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from pagedserve.kernels.backends import BACKENDS, KV_CACHE_DTYPES, PRODUCT_CACHE_DTYPES, QUANTIZATIONS
from pagedserve.runtime.env import checked, fraction, non_negative, positive
from pagedserve.worker.core.kv_cache.block_pool import BLOCK_SIZE
from pagedserve.worker.core.scheduling.config import PREEMPTION_MODES, PreemptionMode
from pagedserve.worker.core.speculative.config import SpeculativeConfig
from pagedserve.worker.runner.simulated_cost import SimulatedCost

CPU_KV_FRACTION = 0.25  # of available RAM, when no budget is given on a CPU
GIB = 1 << 30
CPU_KV_CAP = GIB
GGUF_ACTIVATIONS = ("int16", "int8")  # --gguf-activations: what the GGUF row kernel takes its input at
SERVED_STEP_MS = 300.0  # a server's step target: a long prompt pauses its streams ~0.3 s at most (docs/benchmarks.md)


@dataclass(frozen=True)
class Flag:
    """How a setting is given on a command line. ``unit``: the flag counts in these (a GiB flag of
    a bytes setting), converted to the setting's own unit."""
    help: str = ""
    kind: Callable | None = None
    choices: tuple[str, ...] | None = None
    switch: str = ""  # "on": a presence flag (store_true); "both": --x / --no-x
    unit: int = 1
    metavar: str | None = None
    many: bool = False  # one or more values after the flag (a tuple; its environment variable splits on spaces)
    served: Any = None  # the command line's default (a server's: worker, serve) where it differs from the library's (LLM)


def flag(default: Any, help: str = "", **how) -> Any:
    return field(default=default, metadata={"flag": Flag(help, **how)})


def _is_step_cost(text: str) -> bool:
    try:
        SimulatedCost.parse(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = flag("auto", "the weights' and activations' dtype; auto: the one the model's config names, "
                      "else float32", choices=("auto", "float32", "bfloat16", "float16"))
    device: str | None = flag(None, "cpu, cuda or cuda:N (default: cuda when available)")
    attention_backend: str = flag(
        "auto", "auto: Triton kernels on CUDA, the C kernel compiled for this CPU elsewhere (torch if it cannot be "
        "built); torch: the plain PyTorch reference", choices=BACKENDS)
    block_size: int = flag(BLOCK_SIZE, "tokens per KV block", kind=positive(int))
    kv_cache_dtype: str = flag("auto", "how K/V are stored: auto (the model's dtype) or one byte per element, with a "
                               "bfloat16 scale per token and KV head (fp8 = fp8_e4m3)",
                               choices=KV_CACHE_DTYPES)
    quantized_products: bool = flag(
        False, "with an int8 or fp8_e4m3 cache, decode attention multiplies the codes as stored on the GPU's 8-bit "
        "tensor cores, queries and probabilities quantized to the cache's codes too (lossy beyond the cache: "
        "docs/engine.md; Triton on CUDA, or --attention-backend torch for its numbers on a CPU)", switch="on")
    kv_cache_memory: int | None = flag(None, "bytes for the KV pool (default: on CUDA what --gpu-memory-utilization "
                                       "leaves; on a CPU a quarter of the available RAM, at most 1 GiB)", kind=positive(int))
    quantization: str = flag("auto", "the linear layers' weights: auto (gguf for a quantized GGUF file on a CPU, else "
                             "none), gguf (the file's Q4_K/Q6_K/Q8_0 blocks run as stored), none (the model's dtype), "
                             "int8 (a scale per output channel) or int4 (a scale and zero per 32 inputs); CPU only so "
                             "far", choices=QUANTIZATIONS)
    gguf_activations: str = flag("int16", "what a GGUF's Q4_K/Q6_K matrices run as stored take their input at: int16 per "
                                 "256 values (the 1.5B's perplexity 0.05 percent from the file's dequantized reading) or "
                                 "int8 per 256, as llama.cpp takes it (on AVX-512 VNNI: steps 20-30 percent faster, "
                                 "perplexity 1 percent from it; elsewhere int16; docs/engine.md)", choices=GGUF_ACTIVATIONS)
    num_gpu_blocks: int | None = flag(None, "exact KV pool size in blocks (default: what --kv-cache-memory holds)",
                                      kind=positive(int))
    swap_space: int = flag(GIB, "GiB of CPU memory for KV blocks of preempted requests (with --preemption-mode swap)",
                           kind=non_negative(float), unit=GIB)
    num_cpu_blocks: int | None = None  # exact CPU pool size (overrides swap_space)
    kv_offload_host_bytes: int = flag(
        0, "bytes of host memory under the prefix cache: full blocks the KV pool evicts are kept there, and a prompt "
        "that comes back copies its prefix up instead of recomputing it (0: no host tier)", kind=non_negative(int))
    num_host_blocks: int | None = None  # exact host tier size (overrides kv_offload_host_bytes)
    kv_offload_dir: str | None = flag(
        None, "a directory under the host tier (or the pool): evicted prefix blocks kept as verified files, found again "
        "by a worker restarted on the same model; workers may share it (default: no disk tier)")
    kv_offload_disk_bytes: int = flag(4 * GIB, "bytes of --kv-offload-dir this worker fills at most",
                                      kind=non_negative(int))
    speculative_config: str | dict | None = flag(
        None, 'speculative decoding, as vLLM spells it (JSON): {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1} drafts a row\'s next tokens from its own history '
        'and checks them in one forward; {"model": DRAFT, "num_speculative_tokens": 4, "quantization": "int4"} '
        "drafts with a small draft model of the same vocabulary (default: off)", metavar="JSON")
    enable_lora: bool = flag(False, "serve LoRA adapters on the base model (--lora-modules; requests name one as their "
                             "model)", switch="on")
    lora_modules: tuple[str, ...] = flag((), "adapters loaded at start, NAME=PATH each (a PEFT adapter directory)",
                                         many=True, metavar="NAME=PATH")
    max_loras: int = flag(4, "adapters on the device at once (more are kept in host memory, least recently used "
                          "out)", kind=positive(int))
    max_lora_rank: int = flag(16, "the highest adapter rank accepted", kind=positive(int))
    tensor_parallel_size: int = flag(1, "processes the model is split across, one per GPU on CUDA (gloo between "
                                     "processes on a CPU): heads, MLP widths and vocabulary divided between them",
                                     kind=positive(int))
    max_num_seqs: int = flag(256, "sequences in one running batch at most", kind=positive(int))
    max_num_batched_tokens: int = flag(2048, "tokens in one engine step at most (prefill chunks and decodes)",
                                       kind=positive(int))
    max_step_ms: float | None = flag(
        None, "a step that carries decoding sequences takes about this long at most: prefill chunks beside them are "
        "sized by a fit of the engine's own step times (attention over a long context included), so a long prompt "
        f"never pauses the streams for longer (a server's default {SERVED_STEP_MS:g}; LLM's and 0: off, chunks sized "
        "by --max-num-batched-tokens alone)", kind=non_negative(float), served=SERVED_STEP_MS)
    max_model_len: int | None = flag(None, "the longest prompt + output served (default: the model's context)",
                                     kind=positive(int))
    enable_prefix_caching: bool = flag(True, "share KV blocks of identical prompt prefixes", switch="both")
    hybrid_kv_cache: bool = flag(True, "a model mixing sliding-window and full attention (Gemma 2 and 3) keeps a block "
                                 "table per group of layers, a sliding group only its window's blocks (off: one table "
                                 "for every layer, holding every position)", switch="both")
    preemption_mode: PreemptionMode = flag("recompute", "what a preempted request's KV does: recomputed later, or "
                                           "swapped to CPU memory (--swap-space)", choices=PREEMPTION_MODES)
    async_scheduling: bool = flag(
        False, "plan each step on the host while the device runs the one before, and read that one's tokens while "
        "the next runs (the same tokens; steps with grammars, beams, n > 1, prompt logprobs or embeddings, and "
        "engines with speculative decoding or tensor parallel, run one step at a time)",
        switch="both")
    seed: int = 0
    enforce_eager: bool = flag(False, "CUDA: run decode steps eagerly instead of replaying CUDA graphs", switch="on")
    gpu_memory_utilization: float = flag(
        0.9, "share of the GPU's memory for weights, KV cache and a step's activations (0, 1]", kind=fraction)
    generation_config: str = "auto"  # "auto": the model's generation_config.json gives the default SamplingParams; "vllm": not
    simulate: str | None = flag(
        None, "no model forward: each step sleeps BASE + PER_SEQ x sequences + PER_TOKEN x tokens seconds (scale "
        "measurements, bench/scale.py; calibrate with bench/scale.py --calibrate; default: off, the model runs)",
        kind=checked(str, _is_step_cost, "three seconds >= 0, BASE,PER_SEQ,PER_TOKEN"), metavar="BASE,PER_SEQ,PER_TOKEN")

    def __post_init__(self) -> None:
        for name in ("kv_cache_memory", "num_gpu_blocks", "num_cpu_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not isinstance(self.swap_space, int) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a number of bytes >= 0, got {self.swap_space!r}")
        for name in ("kv_offload_host_bytes", "kv_offload_disk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a number of bytes >= 0, got {value!r}")
        if self.num_host_blocks is not None and (not isinstance(self.num_host_blocks, int) or self.num_host_blocks < 0):
            raise ValueError(f"num_host_blocks must be an integer >= 0 or None, got {self.num_host_blocks!r}")
        if isinstance(self.lora_modules, (list, str)):  # LLM(lora_modules=[...]) or one item
            object.__setattr__(self, "lora_modules", (self.lora_modules,) if isinstance(self.lora_modules, str) else tuple(self.lora_modules))
        for module in self.lora_modules:
            name, _, path = module.partition("=") if isinstance(module, str) else ("", "", "")
            if not (name and path):
                raise ValueError(f"lora_modules takes NAME=PATH items, got {module!r}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        self._check_tensor_parallel()
        if self.gguf_activations not in GGUF_ACTIVATIONS:
            raise ValueError(f"gguf_activations must be one of {', '.join(GGUF_ACTIVATIONS)}, got {self.gguf_activations!r}")
        if self.quantized_products and self.kv_cache_dtype not in PRODUCT_CACHE_DTYPES:
            raise ValueError(f"quantized_products multiplies an 8-bit cache's codes: it needs kv_cache_dtype int8, fp8 or "
                             f"fp8_e4m3, got {self.kv_cache_dtype!r}")
        spec = SpeculativeConfig.parse(self.speculative_config)  # a bad --speculative-config fails here, with its reason
        if spec is not None and spec.quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative quantization must be one of {', '.join(QUANTIZATIONS)}, got {spec.quantization!r}")

    def _check_tensor_parallel(self) -> None:
        """What tensor parallel does not combine with yet: a clear error at start."""
        if self.tensor_parallel_size == 1:
            return
        refused = {"the disk KV tier (kv_offload_dir)": self.kv_offload_dir is not None,
                   "simulate": self.simulate is not None}
        named = [name for name, on in refused.items() if on]
        if named:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} does not combine with "
                             f"{', '.join(named)} yet")

    @property
    def lora_adapters(self) -> dict[str, str]:
        """``--lora-modules`` as name -> path."""
        return dict(module.split("=", 1) for module in self.lora_modules)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return SpeculativeConfig.parse(self.speculative_config)

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

    def host_blocks(self, block_bytes: int) -> int:
        """Blocks of the host tier under the prefix cache (0: none)."""
        if self.num_host_blocks is not None:
            return self.num_host_blocks
        return self.kv_offload_host_bytes // block_bytes if block_bytes else 0

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
