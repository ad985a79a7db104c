"""Batched sampling with per-row parameters, on the logits' device.

Order per row, as transformers' warpers and vLLM apply it: ``min_tokens`` (EOS and stop ids
masked), repetition penalty (prompt and output tokens), presence and frequency penalties (output
tokens); then greedy argmax, or temperature, top-k, top-p over the renormalised top-k
distribution, min-p, and a draw. Rows with a grammar (structured outputs) have every token it
forbids set to -inf after the penalties (``worker/runner/sampling/structured_masks.py``). Every per-row parameter is a tensor built once per step from the
rows; token histories become one padded matrix, scattered into masks and counts, so no Python
loop touches vocabulary-sized work. Reported logprobs are of the raw model distribution
(``log_softmax`` before any processing), like vLLM's default; they reach the host once per step,
in one queued copy (``drawn_tokens.py``: ``draw`` returns before it lands, ``sample`` waits).

Seeded rows draw with a generator (on the logits' device) seeded from ``(seed, output index,
position)``, so the same seed gives the same tokens whatever else is in the batch and across
preemption; unseeded rows share one generator on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.scheduling.plan import SampledToken
from pagedserve.worker.runner.sampling.drawn_tokens import DrawnTokens
from pagedserve.worker.runner.sampling.structured_masks import mask_logits
from pagedserve.worker.runner.transfers.host_copies import device_tensor


@dataclass(frozen=True)
class SampleRow:
    """What sampling reads of a row; ``worker.core.plan.ScheduledSeq`` has the same fields."""

    params: SamplingParams
    prompt_ids: tuple[int, ...]  # token history: needed only by the penalties
    output_ids: tuple[int, ...]
    seq_index: int  # which of the request's n outputs (the first of a fork's rows)
    num_samples: int  # > 1 only where a request forks: one row per child
    num_output: int  # tokens generated so far (min_tokens, seeded draws)
    grammar: object = None  # the row's grammar state when its output is constrained


class Sampler:
    def __init__(self, eos_token_ids: frozenset[int], seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[list[SampledToken]]:
        """``logits`` ``[len(rows), vocab]`` -> ``num_samples`` tokens per row."""
        return self.draw(logits, rows).read()

    def draw(self, logits: torch.Tensor, rows: Sequence[SampleRow], history_tails: torch.Tensor | None = None) -> DrawnTokens:
        """``sample`` without the wait: the tokens drawn on the device, their copy to the host queued.
        ``history_tails``: int64 ``[len(rows)]`` on the device, the token each row's history lacks (its
        placeholder's, ``worker/core/scheduling/run_ahead.py``), the vocabulary size where none."""
        dev = logits.device
        logits = logits.float()
        if any(r.num_samples > 1 for r in rows):
            repeats = device_tensor([r.num_samples for r in rows], torch.int64, dev)
            logits = logits.repeat_interleave(repeats, dim=0)
            history_tails = None if history_tails is None else history_tails.repeat_interleave(repeats)
        flat = [(r, r.seq_index + k if r.num_samples > 1 else r.seq_index) for r in rows for k in range(r.num_samples)]
        params = [r.params for r, _ in flat]
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        processed = apply_penalties(logits, [r for r, _ in flat], self.eos_token_ids, history_tails)  # a new tensor where it changes any
        processed = mask_logits(processed, [r.grammar for r, _ in flat])
        tokens = self._draw(processed, flat)
        picked = raw_logprobs.gather(1, tokens[:, None])[:, 0]
        wants = [p.logprobs is not None for p in params]
        ranks = vocab_ranks(raw_logprobs, picked) if any(wants) else None
        top_k = {i: p.logprobs for i, p in enumerate(params) if p.logprobs}
        return DrawnTokens.queue([r.num_samples for r in rows], wants, top_k, tokens, picked, ranks,
                                 _top_logprobs(raw_logprobs, top_k))

    def _draw(self, logits: torch.Tensor, flat: list[tuple[SampleRow, int]]) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, (r, _) in enumerate(flat) if not r.params.greedy]
        if not random_rows:
            return tokens
        idx = device_tensor(random_rows, torch.int64, logits.device)
        probs = filtered_probs(logits[idx], [flat[i][0].params for i in random_rows])
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for j, i in enumerate(random_rows):
            row, seq_index = flat[i]
            if row.params.seed is not None:
                gen = torch.Generator(device=logits.device).manual_seed(_mix(row.params.seed, seq_index, row.num_output))
                noise[j].exponential_(generator=gen)
        # Exponential race: argmax(p / E) draws from p, one independent E per token.
        tokens[idx] = (probs / noise).argmax(dim=-1)
        return tokens


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow], eos_token_ids: tuple[int, ...],
                    history_tails: torch.Tensor | None = None) -> torch.Tensor:
    """min_tokens masking, then repetition, presence and frequency penalties: a new tensor where any
    applies, ``logits`` itself (untouched) where none does (no vocabulary-sized copy on a plain step).
    ``history_tails``: each row's last output token where its history holds a placeholder instead
    (``Sampler.draw``)."""
    vocab = logits.shape[1]
    dev = logits.device
    # A grammar decides when a constrained row may end: min_tokens does not ban its EOS.
    banned = [(*eos_token_ids, *r.params.stop_token_ids) if r.num_output < r.params.min_tokens and r.grammar is None
              else () for r in rows]
    if any(banned):
        logits = logits.masked_fill(_token_mask(banned, vocab, dev), float("-inf"))
    rep = [r.params.repetition_penalty for r in rows]
    if any(p != 1.0 for p in rep):
        seen = _token_mask([(*r.prompt_ids, *r.output_ids) if p != 1.0 else () for r, p in zip(rows, rep)], vocab, dev,
                           history_tails)
        penalty = device_tensor(rep, logits.dtype, dev)[:, None]
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    if any(r.params.presence_penalty or r.params.frequency_penalty for r in rows):
        counts = _token_counts([r.output_ids for r in rows], vocab, dev, history_tails).to(logits.dtype)
        presence = device_tensor([r.params.presence_penalty for r in rows], logits.dtype, dev)[:, None]
        frequency = device_tensor([r.params.frequency_penalty for r in rows], logits.dtype, dev)[:, None]
        logits = logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return logits


def _padded(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[rows, longest]`` int64 token ids padded with ``vocab`` (a column callers drop); ids at or
    past the vocabulary (e.g. stop ids of another tokenizer) also land in that column."""
    width = max((len(t) for t in token_lists), default=0) or 1
    rows = [[t if 0 <= t < vocab else vocab for t in tokens] + [vocab] * (width - len(tokens)) for tokens in token_lists]
    return device_tensor(rows, torch.int64, device)


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device,
                  tails: torch.Tensor | None = None) -> torch.Tensor:
    """``[rows, vocab]`` occurrence counts of each row's tokens (one ``scatter_add_``), and of its
    ``tails`` entry (on the device; ``vocab``: none) where a row holds tokens (a placeholder, -1, is
    counted in no column: its token is the tail)."""
    ids = _padded(token_lists, vocab, device)
    if tails is not None:
        holds = device_tensor([bool(tokens) for tokens in token_lists], torch.bool, device)
        ids = torch.cat([ids, torch.where(holds, tails, vocab)[:, None]], dim=1)
    counts = torch.zeros((ids.shape[0], vocab + 1), dtype=torch.int32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab]


def _token_mask(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device,
                tails: torch.Tensor | None = None) -> torch.Tensor:
    return _token_counts(token_lists, vocab, device, tails) > 0


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p over the renormalised top-k, then min-p, as a
    probability distribution per row (rows need not sum to one; the draw does not care)."""
    dev, dtype = logits.device, logits.dtype
    temps = device_tensor([p.temperature for p in params], dtype, dev)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    vocab = probs.shape[1]
    top_k = device_tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64, dev)
    top_p = device_tensor([p.top_p for p in params], dtype, dev)
    min_p = device_tensor([p.min_p for p in params], dtype, dev)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=dev)[None, :]
    sorted_probs = sorted_probs * (rank < top_k[:, None])
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)  # top-p sees the top-k distribution
    # Keep a token while the mass *before* it is < top_p: the most likely token always survives.
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (before < top_p[:, None]) & (sorted_probs >= min_p[:, None] * sorted_probs[:, :1])
    sorted_probs = sorted_probs * keep
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def _top_logprobs(raw_logprobs: torch.Tensor, top_k: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(values, ids) of the most likely tokens of the rows in ``top_k`` (row -> how many), in row
    order, with one top-k for the step (each row reads its own part: ``DrawnTokens.read``)."""
    if not top_k:
        return None
    idx = device_tensor(sorted(top_k), torch.int64, raw_logprobs.device)
    return raw_logprobs[idx].topk(max(top_k.values()), dim=-1)


def vocab_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Each row's rank of its ``chosen`` logprob among the row's: how many are at least as likely, the
    token itself included (1: the only most likely; vLLM's ``rank``, ties counted against the token,
    so a token tied with the k-th best and not among the k ranks k + 1, never a k twice)."""
    return (logprobs >= chosen[:, None]).sum(dim=-1)


def _mix(seed: int, seq_index: int, position: int) -> int:
    """A 63-bit generator seed from a request seed, the output index and the token position."""
    x = (seed * 0x9E3779B97F4A7C15 + seq_index * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    return x & (2**63 - 1)
