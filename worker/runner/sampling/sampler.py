"""Batched sampling with per-row parameters, on the logits' device.

Order per row, as transformers' warpers and vLLM apply it: ``min_tokens`` (EOS and stop ids
masked), repetition penalty (prompt and output tokens), presence and frequency penalties (output
tokens); then greedy argmax, or temperature, top-k, top-p over the renormalised top-k
distribution, min-p, and a draw. Rows with a grammar (structured outputs) have every token it
forbids set to -inf after the penalties (``worker/runner/sampling/structured_masks.py``). Every per-row parameter is a tensor built once per step from the
rows; token histories become one padded matrix, scattered into masks and counts, so no Python
loop touches vocabulary-sized work. Reported logprobs are of the raw model distribution
(``log_softmax`` before any processing), like vLLM's default; they reach the host once per step.

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
from pagedserve.worker.runner.sampling.structured_masks import mask_logits


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
        dev = logits.device
        logits = logits.float()
        if any(r.num_samples > 1 for r in rows):
            logits = logits.repeat_interleave(torch.tensor([r.num_samples for r in rows], device=dev), dim=0)
        flat = [(r, r.seq_index + k if r.num_samples > 1 else r.seq_index) for r in rows for k in range(r.num_samples)]
        params = [r.params for r, _ in flat]
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        processed = apply_penalties(logits, [r for r, _ in flat], self.eos_token_ids)  # a new tensor where it changes any
        processed = mask_logits(processed, [r.grammar for r, _ in flat])
        tokens = self._draw(processed, flat)
        picked = raw_logprobs.gather(1, tokens[:, None])[:, 0]
        tops = _top_logprobs(raw_logprobs, params)
        ranks = vocab_ranks(raw_logprobs, picked).tolist() if any(p.logprobs is not None for p in params) else None
        token_list, picked_list = tokens.tolist(), picked.tolist()  # the step's one move to the host
        out, i = [], 0
        for r in rows:
            out.append([scored_token(token_list[i + k], picked_list[i + k], tops.get(i + k), r.params.logprobs is not None,
                                     ranks[i + k] if ranks else None)
                        for k in range(r.num_samples)])
            i += r.num_samples
        return out

    def _draw(self, logits: torch.Tensor, flat: list[tuple[SampleRow, int]]) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, (r, _) in enumerate(flat) if not r.params.greedy]
        if not random_rows:
            return tokens
        idx = torch.tensor(random_rows, dtype=torch.int64, device=logits.device)
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


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow], eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """min_tokens masking, then repetition, presence and frequency penalties: a new tensor where any
    applies, ``logits`` itself (untouched) where none does (no vocabulary-sized copy on a plain step)."""
    vocab = logits.shape[1]
    dev = logits.device
    # A grammar decides when a constrained row may end: min_tokens does not ban its EOS.
    banned = [(*eos_token_ids, *r.params.stop_token_ids) if r.num_output < r.params.min_tokens and r.grammar is None
              else () for r in rows]
    if any(banned):
        logits = logits.masked_fill(_token_mask(banned, vocab, dev), float("-inf"))
    rep = [r.params.repetition_penalty for r in rows]
    if any(p != 1.0 for p in rep):
        seen = _token_mask([(*r.prompt_ids, *r.output_ids) if p != 1.0 else () for r, p in zip(rows, rep)], vocab, dev)
        penalty = torch.tensor(rep, dtype=logits.dtype, device=dev)[:, None]
        scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, scaled, logits)
    if any(r.params.presence_penalty or r.params.frequency_penalty for r in rows):
        counts = _token_counts([r.output_ids for r in rows], vocab, dev).to(logits.dtype)
        presence = torch.tensor([r.params.presence_penalty for r in rows], dtype=logits.dtype, device=dev)[:, None]
        frequency = torch.tensor([r.params.frequency_penalty for r in rows], dtype=logits.dtype, device=dev)[:, None]
        logits = logits - frequency * counts - presence * (counts > 0).to(logits.dtype)
    return logits


def _padded(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[rows, longest]`` int64 token ids padded with ``vocab`` (a column callers drop); ids at or
    past the vocabulary (e.g. stop ids of another tokenizer) also land in that column."""
    width = max((len(t) for t in token_lists), default=0) or 1
    rows = [[t if 0 <= t < vocab else vocab for t in tokens] + [vocab] * (width - len(tokens)) for tokens in token_lists]
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _token_counts(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[rows, vocab]`` occurrence counts of each row's tokens (one ``scatter_add_``)."""
    ids = _padded(token_lists, vocab, device)
    counts = torch.zeros((ids.shape[0], vocab + 1), dtype=torch.int32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab]


def _token_mask(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    return _token_counts(token_lists, vocab, device) > 0


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p over the renormalised top-k, then min-p, as a
    probability distribution per row (rows need not sum to one; the draw does not care)."""
    dev, dtype = logits.device, logits.dtype
    temps = torch.tensor([p.temperature for p in params], dtype=dtype, device=dev)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    vocab = probs.shape[1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=dtype, device=dev)
    min_p = torch.tensor([p.min_p for p in params], dtype=dtype, device=dev)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=dev)[None, :]
    sorted_probs = sorted_probs * (rank < top_k[:, None])
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)  # top-p sees the top-k distribution
    # Keep a token while the mass *before* it is < top_p: the most likely token always survives.
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (before < top_p[:, None]) & (sorted_probs >= min_p[:, None] * sorted_probs[:, :1])
    sorted_probs = sorted_probs * keep
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def _top_logprobs(raw_logprobs: torch.Tensor, params: Sequence[SamplingParams]) -> dict[int, tuple[list[int], list[float]]]:
    """Row -> (ids, logprobs) of its ``logprobs`` most likely tokens, with one top-k for the step."""
    wanted = [i for i, p in enumerate(params) if p.logprobs]
    if not wanted:
        return {}
    k = max(params[i].logprobs for i in wanted)
    idx = torch.tensor(wanted, dtype=torch.int64, device=raw_logprobs.device)
    values, ids = raw_logprobs[idx].topk(k, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return {i: (ids[j][: params[i].logprobs], values[j][: params[i].logprobs]) for j, i in enumerate(wanted)}


def vocab_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """Each row's rank of its ``chosen`` logprob among the row's: how many are at least as likely, the
    token itself included (1: the only most likely; vLLM's ``rank``, ties counted against the token,
    so a token tied with the k-th best and not among the k ranks k + 1, never a k twice)."""
    return (logprobs >= chosen[:, None]).sum(dim=-1)


def scored_token(token: int, logprob: float, top: tuple[list[int], list[float]] | None, alternatives: bool,
                 rank: int | None = None) -> SampledToken:
    """``token`` with its logprob and, when ``alternatives``, the top ``(ids, logprobs)`` with the
    token itself always among them, and its rank in the vocabulary (sampled tokens, and prompt
    tokens for ``prompt_logprobs``)."""
    found = None
    if alternatives:
        found = dict(zip(*top)) if top else {}
        if token in found:  # among the top: its place there is its rank (as vLLM's entry says), whatever ties
            rank = top[0].index(token) + 1
        found[token] = logprob
    return SampledToken(token, logprob, found, rank if alternatives else None)


def _mix(seed: int, seq_index: int, position: int) -> int:
    """A 63-bit generator seed from a request seed, the output index and the token position."""
    x = (seed * 0x9E3779B97F4A7C15 + seq_index * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    return x & (2**63 - 1)
