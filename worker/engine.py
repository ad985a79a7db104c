"""The engine: a model, its KV cache and a scheduler, stepped three calls at a time. No I/O.

    plan = scheduler.schedule()          # which sequences compute how many tokens, block moves
    result = runner.launch(plan).result()   # block moves, one forward, sampling and beam steps
    outputs = scheduler.update(plan, result)   # tokens applied, stops, detokenized outputs

With ``--async-scheduling`` a step stays in flight while the next is planned and launched, and its
update comes after that launch (``worker/core/scheduling/run_ahead.py``). Callers (the offline
``LLM``, the worker service) add requests, call ``step()`` in a loop and read the outputs.
"""

from __future__ import annotations

import time
import weakref
from pathlib import Path
from typing import Hashable, Sequence as Seq

import structlog
import torch

from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.prompts import check_token_ids
from pagedserve.shared.sampling import SamplingParams
from pagedserve.shared.sampling_defaults import generation_defaults
from pagedserve.worker.core.kv_cache.disk_tier import DiskTier
from pagedserve.worker.core.kv_cache.host_tier import HostTier
from pagedserve.worker.core.kv_cache.kv_events import KvEvents
from pagedserve.worker.core.kv_cache.tiers import KvTiers
from pagedserve.worker.core.scheduling.config import SchedulerConfig
from pagedserve.worker.core.scheduling.detokenizer import Detokenizer
from pagedserve.worker.core.scheduling.engine_stats import engine_stats
from pagedserve.worker.core.scheduling.kv_snapshot import kv_snapshot
from pagedserve.worker.core.scheduling.outputs import RequestOutput
from pagedserve.worker.core.scheduling.request import Request
from pagedserve.worker.core.scheduling.scheduler import Scheduler
from pagedserve.worker.in_flight import InFlight
from pagedserve.worker.runner.attention.key_rotation import calibration_text
from pagedserve.worker.runner.device.failures import DeviceFailure, device_guard
from pagedserve.worker.runner.kv_cache.tier_storage import TierCopier, tier_fingerprint
from pagedserve.worker.runner.loader import inspect_model
from pagedserve.worker.runner.lora.adapters import Adapters
from pagedserve.worker.runner.lora.peft_adapter import AdapterBusy, LoraError
from pagedserve.worker.runner.models.layers import kv_layout
from pagedserve.worker.runner.models.rope import rope_switch
from pagedserve.worker.runner.sampling.structured_masks import GrammarCompiler
from pagedserve.worker.runner.simulated import SimulatedRunner
from pagedserve.worker.runner.simulated_cost import SimulatedCost
from pagedserve.worker.setup.engine_config import EngineConfig
from pagedserve.worker.setup.kv_budget import KvBudget
from pagedserve.worker.setup.ranks import Ranks
from pagedserve.worker.setup.runner_build import build_runner
from pagedserve.worker.step_loop import StepLoop, StepTiming

log = structlog.get_logger("pagedserve.engine")


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        device = self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        info = self.info = inspect_model(config.model, config.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(info.path)
        max_len = min(config.max_model_len or info.max_model_len, info.max_model_len)
        if config.max_model_len and config.max_model_len > max_len:
            log.warning("max_model_len capped to the model's context: positions past it were never trained",
                        asked=config.max_model_len, max_model_len=max_len)
        eos = frozenset(info.eos_token_ids | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()))
        self.adapters: Adapters | None = None  # LoRA (--enable-lora)
        self.ranks: Ranks | None = None  # the other tensor-parallel ranks (--tensor-parallel-size)
        if config.simulate:  # no weights: the pool is bookkeeping only
            block_bytes, num_gpu, num_cpu = 0, config.num_gpu_blocks or 4096, config.num_cpu_blocks or 0
            self.runner = SimulatedRunner(SimulatedCost.parse(config.simulate), info.config.vocab_size, eos)
        else:
            with device_guard(device):  # --device cuda:N: loading, profiling and capture on N
                built = build_runner(config, info, device, eos, max_len, self._calibration_ids)
            self.runner, self.ranks, self.adapters = built.runner, built.ranks, built.adapters
            block_bytes, num_gpu, num_cpu = built.block_bytes, built.num_gpu, built.num_cpu
            if self.ranks is not None:
                weakref.finalize(self, self.ranks.close)  # an engine dropped unclosed (the offline LLM) stops them too
        self.kv_bytes_per_token = block_bytes // config.block_size
        layout = kv_layout(info.config, config.hybrid_kv_cache)
        max_len = KvBudget(num_gpu, config.block_size, self.kv_bytes_per_token, layout.lane_windows,
                           config.max_num_batched_tokens).context(max_len, asked=bool(config.max_model_len))
        tiers = None if config.simulate else self._kv_tiers(block_bytes)
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_gpu_blocks=num_gpu, block_size=config.block_size, num_cpu_blocks=num_cpu,
                max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_len, enable_prefix_caching=config.enable_prefix_caching,
                preemption_mode=config.preemption_mode, lane_windows=layout.lane_windows,
                rope_switch=rope_switch(info.config), speculative=config.speculative,
                max_loras=config.max_loras if config.enable_lora else 0, max_step_ms=config.max_step_ms or None,
            ),
            eos_token_ids=eos, detokenizer=Detokenizer(self.tokenizer), tiers=tiers,
        )
        self.steps = StepLoop(self.scheduler, self.runner, device, self.ranks,
                              runs_ahead=config.async_scheduling and self._may_run_ahead())
        self.sampling_defaults = generation_defaults(info.path, config.generation_config)
        self.grammars = GrammarCompiler(self.tokenizer, info.config.vocab_size, eos)
        log.info(
            "kv cache allocated", sampling_defaults=self.sampling_defaults or "none", device=str(device), dtype=str(info.dtype).replace("torch.", ""),
            gpu_blocks=num_gpu, cpu_blocks=num_cpu, block_size=config.block_size,
            kv_bytes=num_gpu * block_bytes, kv_cache_dtype=config.kv_cache_dtype,
            quantized_products=config.quantized_products, quantization=config.quantization,
            kv_bytes_per_token=self.kv_bytes_per_token, max_tokens_in_cache=num_gpu * config.block_size, max_model_len=max_len,
        )

    def _may_run_ahead(self) -> bool:
        """Whether ``--async-scheduling`` can plan ahead here (said in the log where it cannot)."""
        without = [name for name, on in (("speculative decoding", self.config.speculative is not None),
                                         ("tensor parallel", self.ranks is not None),
                                         ("simulate", self.config.simulate is not None)) if on]
        if without:
            log.warning("async scheduling is off: its steps run one at a time", because=", ".join(without))
        return not without

    def _calibration_ids(self, max_len: int) -> list[int]:
        """The shipped calibration text's token ids (a quantized cache's key turns), up to ``max_len``."""
        return self.tokenizer.encode(calibration_text(), add_special_tokens=False)[:max_len]

    def _kv_tiers(self, block_bytes: int) -> KvTiers | None:
        """The host and disk tiers under the prefix cache (``--kv-offload-*``), their bytes on the
        runner; None without either (or without a prefix cache)."""
        config, pool = self.config, self.runner.kv_pool
        num_host = config.host_blocks(block_bytes)
        if not config.enable_prefix_caching or (num_host == 0 and config.kv_offload_dir is None):
            return None
        disk = None
        if config.kv_offload_dir is not None:
            fingerprint = tier_fingerprint(self.info.path, pool, dtype=str(self.info.dtype), kv=config.kv_cache_dtype,
                                           quantization=config.quantization)
            disk = DiskTier(Path(config.kv_offload_dir), fingerprint, config.kv_offload_disk_bytes,
                            TierCopier.payload_bytes(pool))
        self.runner.tiers = TierCopier(pool, num_host, disk)
        if self.ranks is not None:  # each rank keeps its part of every host slot (moves go by slot and block id)
            self.ranks.announce("host_tier", num_host)
        log.info("kv tiers under the prefix cache", host_blocks=num_host, host_bytes=num_host * block_bytes,
                 disk_dir=None if disk is None else str(disk.root), disk_blocks_found=0 if disk is None else len(disk),
                 disk_bytes=config.kv_offload_disk_bytes if disk is not None else 0)
        return KvTiers(HostTier(num_host) if num_host else None, disk)

    def encode(self, prompt: str | Seq[int]) -> list[int]:
        """Token ids of a prompt: text encoded, ids checked against the model's vocabulary (the one
        bound, ``config.vocab_size``: the embedding's rows)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return check_token_ids(prompt, self.info.config.vocab_size)

    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams, **options) -> Request:
        """Queue a request (``options``: as ``add_encoded``)."""
        return self.add_encoded(request_id, self.encode(prompt), params, **options)

    def add_encoded(
        self, request_id: str, ids: list[int], params: SamplingParams, *,
        priority: int = 0, deadline: float | None = None, extra_key: Hashable = None, resume_output: Seq[int] = (),
        adapter: str | None = None,
    ) -> Request:
        """Queue a request whose ids came from ``encode`` (the serve layer encodes on its I/O
        thread). ``deadline`` is wall-clock (``time.time()``) seconds; ``resume_output``: output
        tokens a client already has from a worker that died (``shared.protocol.Resume``);
        ``adapter``: the name of a loaded LoRA adapter to run under (its blocks are salted with it,
        so no other adapter or the base model ever shares them)."""
        resumed = check_token_ids(resume_output, self.info.config.vocab_size, "resume") if resume_output else ()
        if adapter is not None:
            extra_key = (self.adapter_salt(adapter), extra_key)
        monotonic_deadline = None if deadline is None else time.monotonic() + (deadline - time.time())
        grammar = None if params.structured is None else self.grammars.compile(params.structured)
        return self.scheduler.add(request_id, ids, params, priority=priority, deadline=monotonic_deadline,
                                  extra_key=extra_key, resume_output=resumed, grammar=grammar, adapter=adapter)

    def adapter_salt(self, name: str) -> str:
        """The loaded adapter ``name``'s prefix-cache salt (an InvalidRequestError when there is none)."""
        if self.adapters is None:
            raise InvalidRequestError(f"model {name!r}: LoRA adapters are off (start with --enable-lora)", "model")
        try:
            return self.adapters.salt(name)
        except LoraError as err:
            raise InvalidRequestError(str(err), "model") from None

    def load_adapter(self, name: str, path: str) -> None:
        """Read the PEFT adapter at ``path`` under ``name`` (a ``LoraError`` saying why it cannot be
        served); replacing a loaded one is refused while a request runs under it."""
        self._idle_adapter(name, "replace")
        self.adapters.load(name, path)
        if self.ranks is not None:  # read and checked here first: the other ranks read their parts
            self.ranks.announce("load_adapter", name, path)

    def unload_adapter(self, name: str) -> None:
        """Forget adapter ``name``; refused while a request runs under it."""
        self._idle_adapter(name, "unload")
        self.adapters.unload(name)
        if self.ranks is not None:
            self.ranks.announce("unload_adapter", name)

    def _idle_adapter(self, name: str, change: str) -> None:
        if self.adapters is None:
            raise LoraError("LoRA adapters are off (start with --enable-lora)")
        busy = sum(r.adapter == name for r in self.scheduler.requests.values())
        if busy:
            raise AdapterBusy(f"adapter {name!r} is in use by {busy} request(s); {change} it when they are done")

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or self.in_flight is not None

    # ------------------------------------------------------------------ what the serve layer reads
    def stats(self) -> dict[str, float]:
        """The engine's numbers (``worker/core/scheduling/engine_stats.py``); on the engine thread."""
        stats = engine_stats(self.scheduler)
        if self.runner.tiers is not None:
            stats["kv_tier_copy_up_seconds_total"] = self.runner.tiers.copy_up_seconds
        return stats

    def limits(self) -> dict[str, int | str]:
        """The facts fixed when the engine started that a gateway needs (``shared/worker_info.py``):
        its context, the token ids it accepts, how it hashes blocks, its capacity, its KV cache's
        format and bytes per token."""
        config = self.scheduler.config
        return {"max_model_len": config.max_model_len, "vocab_size": self.info.config.vocab_size,
                "block_size": config.block_size, "rope_switch": config.rope_switch, "max_num_seqs": config.max_num_seqs,
                "kv_cache_dtype": self.config.kv_cache_dtype, "kv_bytes_per_token": self.kv_bytes_per_token,
                "adapters": tuple(sorted(a.key for a in self.adapters.loaded.values())) if self.adapters is not None else (),
                "max_loras": self.adapters.max_loras if self.adapters is not None else 0}

    def kv_snapshot(self) -> dict:
        """What the KV dashboard shows of this engine (``worker/core/scheduling/kv_snapshot.py``), with how its
        cache stores K/V."""
        return {**kv_snapshot(self.scheduler), "kv_cache_dtype": self.config.kv_cache_dtype,
                "kv_bytes_per_token": self.kv_bytes_per_token}

    def record_kv_events(self, events: KvEvents | None) -> None:
        """Have ``events`` told each block hash the prefix cache publishes or drops (for routing)."""
        self.scheduler.record_kv_events(events)

    def cached_hashes(self) -> list[int]:
        return self.scheduler.cached_hashes()

    def spec_counts(self) -> list[int]:
        """Speculative drafts accepted, by position in the draft (empty when it is off)."""
        spec = self.scheduler.config.speculative
        return self.scheduler.applier.spec_stats.accepted_by_position[: spec.num_speculative_tokens] if spec else []

    def lowered_hashes(self) -> list[int]:
        """Hashes held only below the device (host, disk tiers)."""
        return self.scheduler.lowered_hashes()

    def forget_cached(self) -> None:
        self.scheduler.forget_cached()

    def close(self) -> None:
        """Write every cached block the disk tier lacks (from the device and the host tier) and
        stop its threads, so an engine started later on the directory finds this one's whole
        prefix cache, and stop the other tensor-parallel ranks; the engine serves nothing after. On
        the engine thread, once it is idle."""
        if self.ranks is not None:
            self.ranks.close()
        tiers, blocks = self.runner.tiers, self.scheduler.blocks
        if tiers is None or tiers.disk is None:
            return
        spills = blocks.tiers.write_back(blocks.gpu.hashed_blocks())
        tiers.spill(spills, wait=True)
        tiers.disk.close()
        log.info("kv disk tier written back", blocks=len(spills), files=len(tiers.disk), dir=str(tiers.disk.root))

    # ------------------------------------------------------------------ the step
    def check_ranks(self) -> None:
        """A ``DeviceFailure`` when a tensor-parallel rank is gone: nothing more can run (the serve
        layer asks between steps and while idle, so the worker ends promptly either way)."""
        if self.ranks is not None and self.ranks.lost:
            raise DeviceFailure(self.ranks.lost)

    def step(self) -> list[RequestOutput]:
        """One step (``worker/step_loop.py``): the outputs of the step whose tokens came in."""
        self.check_ranks()
        return self.steps.step()

    @property
    def in_flight(self) -> InFlight | None:
        """The step launched ahead whose tokens are not applied yet (``--async-scheduling``)."""
        return self.steps.in_flight

    @property
    def last_forward(self) -> StepTiming | None:
        return self.steps.last_forward

    @property
    def runs_ahead(self) -> bool:
        """Whether steps may be planned while the one before runs (``--async-scheduling``, where it can)."""
        return self.steps.runs_ahead
