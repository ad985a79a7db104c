"""Executes a StepPlan: block moves first, then one forward over the whole mixed batch, then the
next tokens (``Sampler``) and beam-search steps (``BeamSearcher``) of the rows that sample.

The runner owns the KV tensors (one K and one V per layer on the device, and a CPU pool for swap)
and turns the plan into tensors: input ids, positions, slot mapping, block tables. Each row
carries its sampling parameters, so the runner never asks the scheduler anything, and it makes
no scheduling decision.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from tqdm.auto import tqdm

from pagedserve.kernels.kv_format import AUTO, KVFormat
from pagedserve.kernels.ops import AttentionOps
from pagedserve.kernels.reference import block_pairs
from pagedserve.worker.core.scheduling.plan import SampledToken, ScheduledSeq, StepPlan, StepResult
from pagedserve.worker.runner.attention.kept_tables import KeptTables
from pagedserve.worker.runner.attention.step_inputs import step_inputs
from pagedserve.worker.runner.device.cuda_graphs import DecodeGraphs, GraphLimits
from pagedserve.worker.runner.device.launched_step import LaunchedStep, Placeholders, StepTimer
from pagedserve.worker.runner.kv_cache.pool import layer_caches, pool_shape, zeroed_pool
from pagedserve.worker.runner.kv_cache.tier_storage import TierCopier
from pagedserve.worker.runner.lora.adapters import Adapters
from pagedserve.worker.runner.lora.graph_stack import GraphStack
from pagedserve.worker.runner.models.layers import CausalLM
from pagedserve.worker.runner.sampling.beam_search import BeamSearcher
from pagedserve.worker.runner.sampling.drawn_tokens import scored_token
from pagedserve.worker.runner.sampling.sampler import Sampler, vocab_ranks
from pagedserve.worker.runner.speculative.draft_check import check_drafts
from pagedserve.worker.runner.speculative.draft_model import Drafter
from pagedserve.worker.runner.transfers.host_copies import device_tensor


@dataclass(frozen=True)
class StepLogits:
    logits: torch.Tensor  # float32 [num_rows, vocab]
    items: tuple[ScheduledSeq, ...]  # the sampling sequence of each row
    prompt: dict[int, tuple[SampledToken, ...]] = field(default_factory=dict)  # prompt_logprobs, by seq id
    drafts: dict[int, torch.Tensor] = field(default_factory=dict)  # seq id -> logits [num_draft, vocab] before each draft
    draft_rounds: int = 0  # the draft model's forwards before this one (drafter.py)
    draft_seconds: float = 0.0
    pooled: dict[int, tuple[list[float], int]] = field(default_factory=dict)  # embeddings, by seq id (StepResult.pooled)


PROMPT_LOGPROB_ROWS = 256  # prompt positions whose logits are taken at once


def kv_block_bytes(model: CausalLM, block_size: int, dtype: torch.dtype, kv: KVFormat = AUTO) -> int:
    """Bytes of K and V, all layers, for one block (a quantized row's scale included)."""
    return math.prod(pool_shape(model, 1, block_size, kv)) * kv.bytes_per_element(dtype)


class ModelRunner:
    def __init__(
        self, model: CausalLM, ops: AttentionOps, device: torch.device, dtype: torch.dtype, kv: KVFormat,
        block_size: int, num_gpu_blocks: int, num_cpu_blocks: int, sampler: Sampler, beams: BeamSearcher,
        graph_limits: GraphLimits | None = None, draft: CausalLM | None = None, adapters: Adapters | None = None,
    ) -> None:
        self.model, self.ops, self.device, self.block_size, self.dtype = model, ops, device, block_size, dtype
        self.sampler, self.beams, self.adapters = sampler, beams, adapters
        self.swap_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        shape = pool_shape(model, num_gpu_blocks, block_size, kv)
        dtype = kv.storage_dtype(dtype)
        with tqdm(total=2, desc="allocating KV cache", unit="pool", leave=False, disable=None) as bar:
            self.kv_pool = zeroed_pool(shape, dtype, device)
            bar.update(1)
            self.cpu_pool = zeroed_pool(pool_shape(model, num_cpu_blocks, block_size, kv), dtype, "cpu",
                                        pinned=device.type == "cuda" and num_cpu_blocks > 0)
            bar.update(1)
        self.kv_caches = layer_caches(self.kv_pool, model)
        self.tables = KeptTables(model.kv_layout.num_lanes)  # every sequence's block tables, between steps
        # speculative decoding's draft model, its KV on the same block ids (drafter.py)
        self.drafter = Drafter(draft, ops, device, self.dtype, kv, block_size, num_gpu_blocks) if draft is not None else None
        self.tiers: TierCopier | None = None  # the host and disk tiers' bytes, when the engine has them
        self.announce: Callable[[StepPlan], None] | None = None  # tensor parallel: the plan told to the other ranks
        self.graphs = None
        if graph_limits is not None and device.type == "cuda" and ops.backend == "triton":
            stack = None if adapters is None else GraphStack(adapters)
            self.graphs = DecodeGraphs(model, self.kv_caches, device, block_size, graph_limits, stack)
            if self.drafter is not None:  # the draft model's rounds: graphs of its own, captured on first use
                self.drafter.graphs = DecodeGraphs(draft, self.drafter.kv_caches, device, block_size, graph_limits)
            with tqdm(total=1, desc="capturing CUDA graphs", unit="set", leave=False, disable=None):
                self.graphs.capture_all()

    @torch.inference_mode()
    def warm_decode(self, max_model_len: int) -> None:
        """Compile now every variant of the decode kernel an eager step can launch (one for each
        window and score cap the layers use: the slices' size and count are run-time values), the
        draft model's too: a step that first needed one stalled serving for the compile (0.2-40 s)."""
        tables = torch.zeros((1, 1), dtype=torch.int32, device=self.device)
        lens = torch.ones(1, dtype=torch.int32, device=self.device)
        models = [(self.model, self.kv_caches)] + ([(self.drafter.model, self.drafter.kv_caches)] if self.drafter else [])
        for model, kv_caches in models:
            attention = model.model.layers[0].self_attn
            q = torch.zeros((1, attention.num_heads, attention.head_dim), dtype=self.dtype, device=self.device)
            extras = {tuple(sorted(layer.self_attn.attn.extra.items())) for layer in model.model.layers}
            for extra in sorted(extras):
                self.ops.decode(q, *kv_caches[0], tables, lens, 1.0, max_seq_len=max_model_len, **dict(extra))

    def apply_block_moves(self, plan: StepPlan) -> None:
        """The tiers' spills and demotions (reads of blocks the rest may overwrite), swap out, the
        tiers' promotions and loads, swap in, then copy-on-write: a block freed by a swap-out may
        be reused."""
        tier = plan.tier if self.tiers is not None else None
        if tier:
            self.tiers.before_swaps(tier)
        if plan.swap_out:
            with self._swap_stream():
                self.ops.swap_blocks(self.kv_pool, self.cpu_pool, block_pairs(plan.swap_out, self.device))
        if tier:
            self.tiers.after_swap_out(tier)
        if plan.swap_in:
            with self._swap_stream():
                self.ops.swap_blocks(self.cpu_pool, self.kv_pool, block_pairs(plan.swap_in, self.cpu_pool.device))
        if plan.copies:
            pairs = block_pairs(plan.copies, self.device)
            for pool in (self.kv_pool, self.drafter.kv_pool) if self.drafter is not None else (self.kv_pool,):
                self.ops.copy_blocks(pool, pairs)

    @contextlib.contextmanager
    def _swap_stream(self):
        """On CUDA, swaps run on their own stream, after the work already queued (whose writes a
        swap-out must see) and before anything queued after them (the forward that reuses a
        swapped-out block or reads a swapped-in one): a stream wait on each side."""
        if self.swap_stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.device)
        self.swap_stream.wait_stream(compute)
        with torch.cuda.stream(self.swap_stream):
            yield
        compute.wait_stream(self.swap_stream)

    def execute(self, plan: StepPlan) -> StepResult:
        """Run the plan; the sampled tokens of every sampling row and the beam steps it completes."""
        return self.launch(plan).result()

    @torch.inference_mode()
    def launch(self, plan: StepPlan, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the plan on the device; its sampled tokens reach the host when ``result()`` is asked.
        ``previous``: the step before, still running, whose tokens fill this one's placeholders
        (``worker/core/scheduling/run_ahead.py``)."""
        timer = StepTimer(self.device)
        self.beams.forget(plan.finished_request_ids)
        step = self.forward(plan, previous)
        beam_rows = [i for i, item in enumerate(step.items) if item.params.use_beam_search]
        sampled = [i for i, item in enumerate(step.items) if not item.params.use_beam_search and not item.num_draft]
        samples, beams, drawn = {}, {}, None
        if sampled:
            logits = step.logits if len(sampled) == len(step.items) else \
                step.logits.index_select(0, device_tensor(sampled, torch.int64, self.device))  # all: no copy
            items = [step.items[i] for i in sampled]
            tails = previous.history_tails(items, logits.shape[-1]) if previous is not None else None
            drawn = self.sampler.draw(logits, items, tails)
        drafting = [i for i, item in enumerate(step.items) if item.num_draft]
        if drafting:  # speculative rows: every drafted position checked, all rows in one sampler call
            items = [step.items[i] for i in drafting]
            checked = check_drafts(self.sampler, items, [step.drafts[item.seq_id] for item in items], step.logits[drafting])
            samples.update((item.seq_id, tokens) for item, tokens in zip(items, checked))
        if beam_rows:
            beams = self.beams.step([step.items[i] for i in beam_rows], step.logits[beam_rows])
        timer.stop()
        known = StepResult(samples, beams, step.prompt, step.draft_rounds, step.draft_seconds, step.pooled)
        return LaunchedStep(known, tuple(step.items[i] for i in sampled), drawn, timer)

    @torch.inference_mode()
    def forward(self, plan: StepPlan, previous: LaunchedStep | None = None) -> StepLogits:
        """Block moves, then one forward: logits of the rows that sample this step (placeholder tokens
        filled from ``previous``'s)."""
        self.tables.forget(plan.finished_request_ids, plan.dropped_seq_ids)
        self.tables.update(plan.seqs)
        self.apply_block_moves(plan)
        draft_rounds, draft_seconds = 0, 0.0
        if any(s.draft_context is not None for s in plan.seqs):
            started = time.perf_counter()
            seqs, draft_rounds = self.drafter.draft(plan.seqs, self.tables)  # its rounds read their picks: the time is spent
            plan, draft_seconds = replace(plan, seqs=seqs), time.perf_counter() - started
        if self.announce is not None:  # the other ranks run the same forward, the draft model's drafts in it
            self.announce(plan)
        # Single-token work (decodes, and one-token chunks) goes first, prefill chunks after.
        items = sorted(plan.seqs, key=lambda s: s.num_tokens > 1)
        if not items:
            return StepLogits(torch.empty(0, 0, device=self.device), ())
        holes = previous.placeholders(items) if previous is not None else None
        sampling = [i for i, s in enumerate(items) if s.num_samples]
        wants_prompt = any(s.prompt_targets or s.pool_from is not None for s in items)  # every position's state
        if self.graphs is not None and not wants_prompt and self.graphs.can_run(items):
            every_logits, last_index = self.graphs.run(items, self.tables, holes)  # each token place's logits
            head, prompt, pooled = every_logits.__getitem__, {}, {}
        else:
            head, last_index, prompt, pooled = self._eager(items, wants_prompt, holes)
        rows = device_tensor([last_index[i] for i in sampling], torch.int64, self.device)
        # Speculative rows: the logits before each draft too (the positions ahead of a row's last), in the
        # same head call as the sampling rows' (one read of the head's weights).
        spans = [(s.seq_id, last - s.num_draft, last) for s, last in zip(items, last_index) if s.num_draft]
        if spans:
            ahead = device_tensor([i for _, lo, hi in spans for i in range(lo, hi)], torch.int64, self.device)
            rows = torch.cat([rows, ahead])
        logits = head(rows)
        starts = itertools.accumulate((hi - lo for _, lo, hi in spans), initial=len(sampling))
        drafts = {seq_id: logits[at : at + hi - lo] for (seq_id, lo, hi), at in zip(spans, starts)}
        return StepLogits(logits[: len(sampling)], tuple(items[i] for i in sampling), prompt, drafts, draft_rounds,
                          draft_seconds, pooled)

    def _eager(self, items: list[ScheduledSeq], wants_prompt: bool, holes: Placeholders | None = None):
        """The step's forward without a graph: the logits of chosen token rows (a function, so only the
        rows asked for go through the head), each item's last token's row, and the prompt logprobs and
        pooled states asked for."""
        batch = step_inputs(items, self.block_size, self.device, self.model.rotary.needs_seq_lens,
                            self.model.kv_layout.num_lanes, self.tables)
        if holes is not None:
            holes.fill(batch.ids, range(len(batch.ids)))
        hidden = self._run_model(batch)
        last_index = batch.last_index
        prompt = {s.seq_id: self._prompt_logprobs(hidden, last - s.num_tokens + 1, s)
                  for s, last in zip(items, last_index) if s.prompt_targets} if wants_prompt else {}
        pooled = {s.seq_id: pooled for s, last in zip(items, last_index) if s.pool_from is not None
                  if (pooled := _pool(hidden, last - s.num_tokens + 1, s)) is not None} if wants_prompt else {}
        return (lambda rows: self.model.compute_logits(hidden[rows])), last_index, prompt, pooled

    def _run_model(self, batch) -> torch.Tensor:
        """The model's hidden states for ``batch``, each row under its LoRA adapter where it has one."""
        if self.adapters is None:
            return self.model(batch.ids, batch.positions, batch.meta, self.kv_caches)
        self.adapters.prepare(batch.items)
        try:
            return self.model(batch.ids, batch.positions, batch.meta, self.kv_caches)
        finally:
            self.adapters.clear()

    def _prompt_logprobs(self, hidden: torch.Tensor, first: int, item: ScheduledSeq) -> tuple[SampledToken, ...]:
        """Each chunk position's log-softmax at the prompt token after it, and the top-N, in slices
        of rows (a long chunk's full logits would be chunk x vocab floats at once)."""
        top_n, targets = item.params.prompt_logprobs, item.prompt_targets
        out: list[SampledToken] = []
        for lo in range(0, len(targets), PROMPT_LOGPROB_ROWS):
            hi = min(lo + PROMPT_LOGPROB_ROWS, len(targets))
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[first + lo : first + hi]).float(), dim=-1)
            wanted = device_tensor(targets[lo:hi], torch.int64, logprobs.device)
            chosen = logprobs.gather(1, wanted[:, None])[:, 0]
            ranks = vocab_ranks(logprobs, chosen).tolist()
            top = logprobs.topk(top_n, dim=-1) if top_n else None  # read to the host once a slice
            tops = list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [None] * (hi - lo)
            out.extend(scored_token(token, logprob, best, True, rank)
                       for token, logprob, best, rank in zip(targets[lo:hi], chosen.tolist(), tops, ranks))
        return tuple(out)


def _pool(hidden: torch.Tensor, first: int, item: ScheduledSeq) -> tuple[list[float], int] | None:
    """An embedding row's part of this chunk (``StepResult.pooled``): the float32 sum of its final
    hidden states from position ``pool_from`` on ("mean"), or the prompt's last one ("last") when the
    chunk holds it; None when there is nothing to add."""
    skip = max(0, item.pool_from - item.start)
    rows = hidden[first + skip : first + item.num_tokens].float()
    if item.params.pooling == "last":
        return (rows[-1].tolist(), 1) if len(rows) and item.context_len >= item.seq_len else None  # the prompt's end
    return (rows.sum(dim=0).tolist(), len(rows)) if len(rows) else None

