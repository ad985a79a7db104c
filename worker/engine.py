"""The engine step: aborts and deadlines -> schedule -> run -> sample -> update -> outputs. No I/O.

``Engine`` owns the model, the scheduler, the sampler and the detokenizer. Callers (the offline
``LLM``, the worker service) add requests, call ``step()`` in a loop and read the outputs.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Hashable, Sequence as Seq

import structlog
import torch

from shared.errors import InvalidRequestError
from shared.sampling import SamplingParams
from worker.attention import select_ops
from worker.beam_search import BeamState
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
        self._beams: dict[str, BeamState] = {}
        self._beam_logits: dict[int, torch.Tensor] = {}
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
            beams = {i for i, item in enumerate(result.items) if self._is_beam(item.seq_id)}
            for i in beams:  # kept until every beam of the request has its logits
                self._beam_logits[result.items[i].seq_id] = result.logits[i]
            sampled = [i for i in range(len(result.items)) if i not in beams]
            if sampled:
                items = [result.items[i] for i in sampled]
                rows = [self._sample_row(item.seq_id, item.num_samples) for item in items]
                drawn = self.sampler.sample(result.logits[sampled], rows)
                samples = {item.seq_id: tokens for item, tokens in zip(items, drawn)}
        touched = self.scheduler.update(plan, samples) + self._advance_beams()
        return [out for req in touched if (out := self._output(req)) is not None]

    def _is_beam(self, seq_id: int) -> bool:
        return self.scheduler.owner(seq_id).params.use_beam_search

    def _advance_beams(self) -> list[Request]:
        """One beam-search step for every beam request whose beams all have fresh logits."""
        finished = []
        for req in [r for r in self.scheduler.running if r.params.use_beam_search]:
            live = req.live_seqs
            if not live or any(s.seq_id not in self._beam_logits for s in live):
                continue
            p = req.params
            state = self._beams.setdefault(req.request_id, BeamState(
                p.beam_width, p.max_tokens, p.length_penalty, p.early_stopping,
                () if p.ignore_eos else tuple(sorted(self.scheduler.eos_token_ids)),
            ))
            choices = state.step(torch.stack([self._beam_logits.pop(s.seq_id) for s in live]))
            if state.done:
                self.scheduler.finish_beams(req, state.results(p.n))
                finished.append(req)
            else:
                self.scheduler.apply_beams(req, [(live[c.parent].seq_id, c.token) for c in choices])
        return finished

    def _sample_row(self, seq_id: int, num_samples: int) -> SampleRow:
        seq, req = self.scheduler.seq(seq_id), self.scheduler.owner(seq_id)
        return SampleRow(req.params, req.prompt_ids, seq.output_ids, seq.index, num_samples)

    def _output(self, req: Request) -> RequestOutput | None:
        """The request's progress; beam search and best_of report only their final answers."""
        hold = req.params.use_beam_search or req.params.best_of is not None
        if hold and not req.finished:
            return None
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
                self._beam_logits.pop(seq.seq_id, None)
            self._beams.pop(req.request_id, None)
            if req.params.best_of is not None:
                best = sorted(outputs, key=lambda o: -o.cumulative_logprob)[: req.params.n]
                outputs = [replace(o, index=i) for i, o in enumerate(best)]
        return RequestOutput(req.request_id, req.prompt_ids, outputs, req.finished, req.error)
