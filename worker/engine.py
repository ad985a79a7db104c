"""The engine step: aborts and deadlines -> schedule -> run -> sample -> update -> outputs. No I/O.

``Engine`` owns the model, the scheduler, the sampler and the detokenizer. Callers (the offline
``LLM``, the worker service) add requests, call ``step()`` in a loop and read the outputs.
"""

from __future__ import annotations

import time
from typing import Hashable, Sequence as Seq

import structlog
import torch

from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams
from worker.attention import select_ops
from worker.config import SchedulerConfig
from worker.detokenizer import Detokenizer, DetokenizerState
from worker.engine_config import EngineConfig, available_ram
from worker.loader import inspect_model, load_weights
from worker.model_runner import ModelRunner, kv_block_bytes
from worker.outputs import CompletionOutput, RequestOutput
from worker.request import FinishReason, Request
from worker.sampler import SampleRow, Sampler
from worker.scheduler import Scheduler

log = structlog.get_logger("pagedserve.engine")


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        info = inspect_model(config.model, config.dtype)
        self.info = info
        self.tokenizer = AutoTokenizer.from_pretrained(info.path)
        ops = select_ops(device, config.attention_backend)
        model = load_weights(info, ops, device)
        block_bytes = kv_block_bytes(model, config.block_size, info.dtype)
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_ram()
        num_gpu = config.gpu_blocks(block_bytes, free, device.type == "cuda")
        num_cpu = config.cpu_blocks(block_bytes)
        max_len = min(config.max_model_len or info.max_model_len, info.max_model_len)
        eos = info.eos_token_ids | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set())
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_gpu_blocks=num_gpu, block_size=config.block_size, num_cpu_blocks=num_cpu,
                max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=max_len, enable_prefix_caching=config.enable_prefix_caching,
                preemption_mode=config.preemption_mode,
            ),
            eos_token_ids=frozenset(eos),
        )
        self.runner = ModelRunner(model, ops, device, info.dtype, config.block_size, num_gpu, num_cpu)
        self.sampler = Sampler(frozenset(eos), seed=config.seed)
        self.detokenizer = Detokenizer(self.tokenizer)
        self._detok: dict[int, DetokenizerState] = {}
        log.info(
            "kv cache allocated", device=str(device), dtype=str(info.dtype).replace("torch.", ""),
            gpu_blocks=num_gpu, cpu_blocks=num_cpu, block_size=config.block_size,
            kv_bytes=num_gpu * block_bytes, max_tokens_in_cache=num_gpu * config.block_size, max_model_len=max_len,
        )

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.info.config.vocab_size
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        return ids

    def add_request(
        self, request_id: str, prompt: str | Seq[int], params: SamplingParams, *,
        priority: int = 0, deadline: float | None = None, extra_key: Hashable = None,
    ) -> Request:
        """Queue a request. ``deadline`` is wall-clock (``time.time()``) seconds."""
        ids = self.encode(prompt)
        monotonic_deadline = None if deadline is None else time.monotonic() + (deadline - time.time())
        return self.scheduler.add(request_id, ids, params, priority=priority, deadline=monotonic_deadline, extra_key=extra_key)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        samples = {}
        if not plan.is_empty:
            result = self.runner.execute(plan)
            if result.items:
                rows = [self._sample_row(item.seq_id, item.num_samples) for item in result.items]
                drawn = self.sampler.sample(result.logits, rows)
                samples = {item.seq_id: tokens for item, tokens in zip(result.items, drawn)}
        return [self._output(req) for req in self.scheduler.update(plan, samples)]

    def _sample_row(self, seq_id: int, num_samples: int) -> SampleRow:
        seq, req = self.scheduler.seq(seq_id), self.scheduler.owner(seq_id)
        return SampleRow(req.params, req.prompt_ids, seq.output_ids, seq.index, num_samples)

    def _output(self, req: Request) -> RequestOutput:
        outputs = []
        for seq in req.seqs:
            state = self._detok.get(seq.seq_id) or self.detokenizer.new_state(seq.prompt_len)
            self._detok[seq.seq_id] = state
            seen = state.tokens_seen
            delta = self.detokenizer.update(
                state, seq.token_ids, req.params.stop, req.params.skip_special_tokens, final=seq.finished
            )
            if state.stopped and not seq.finished:
                self.scheduler.finish_seq(seq.seq_id, FinishReason.STOP)
                delta += self.detokenizer.update(state, seq.token_ids, (), req.params.skip_special_tokens, final=True)
            outputs.append(CompletionOutput(
                index=seq.index, text=state.text, token_ids=seq.output_ids,
                finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                cumulative_logprob=seq.cumulative_logprob,
                logprobs=list(seq.logprobs) if req.params.logprobs is not None else None,
                text_delta=delta, new_token_ids=tuple(seq.token_ids[seen:]),
            ))
        if req.finished:
            for seq in req.seqs:
                self._detok.pop(seq.seq_id, None)
        return RequestOutput(req.request_id, req.prompt_ids, outputs, req.finished, req.error)
