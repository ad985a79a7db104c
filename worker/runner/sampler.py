"""Batched sampling with per-request parameters.

Order per row: min_tokens (EOS and stop ids masked), repetition penalty (prompt and output
tokens), presence and frequency penalties (output tokens), then greedy argmax, or temperature,
top-k, top-p, min-p and a draw. Reported logprobs are of the raw model distribution
(``log_softmax`` of the logits before any processing), like vLLM's default.

Seeded rows draw with a generator seeded from ``(seed, output index, position)``, so the same seed
gives the same tokens whatever else is in the batch and across preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.sampling import SamplingParams
from worker.core.plan import SampledToken


@dataclass(frozen=True)
class SampleRow:
    """What sampling reads of a row; ``worker.core.plan.ScheduledSeq`` has the same fields."""

    params: SamplingParams
    prompt_ids: tuple[int, ...]  # token history: needed only by the penalties
    output_ids: tuple[int, ...]
    seq_index: int  # which of the request's n outputs (the first of a fork's rows)
    num_samples: int  # > 1 only where a request forks: one row per child
    num_output: int  # tokens generated so far (min_tokens, seeded draws)


class Sampler:
    def __init__(self, eos_token_ids: frozenset[int], seed: int = 0) -> None:
        self.eos_token_ids = sorted(eos_token_ids)
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[list[SampledToken]]:
        """``logits`` ``[len(rows), vocab]`` -> ``num_samples`` tokens per row."""
        expand = torch.tensor([r.num_samples for r in rows], device=logits.device)
        logits = logits.float().repeat_interleave(expand, dim=0)
        flat = [(r, r.seq_index + k if r.num_samples > 1 else r.seq_index) for r in rows for k in range(r.num_samples)]
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        processed = self._process(logits.clone(), [r for r, _ in flat])
        tokens = self._draw(processed, flat)
        picked = raw_logprobs.gather(1, tokens[:, None])[:, 0]
        out, i = [], 0
        for r in rows:
            out.append([self._token(raw_logprobs[i + k], tokens[i + k], picked[i + k], r.params) for k in range(r.num_samples)])
            i += r.num_samples
        return out

    @staticmethod
    def _token(row_logprobs, token, logprob, params: SamplingParams) -> SampledToken:
        top = None
        if params.logprobs is not None:
            top = {}
            if params.logprobs:
                values, ids = row_logprobs.topk(params.logprobs)
                top = dict(zip(ids.tolist(), values.tolist()))
            top[int(token)] = float(logprob)
        return SampledToken(int(token), float(logprob), top)

    def _process(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        vocab = logits.shape[1]
        for i, r in enumerate(rows):
            p = r.params
            if r.num_output < p.min_tokens:
                banned = [t for t in (*self.eos_token_ids, *p.stop_token_ids) if t < vocab]
                logits[i, banned] = float("-inf")
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.prompt_ids) | set(r.output_ids)), dtype=torch.int64)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and r.output_ids:
                counts = torch.bincount(torch.tensor(r.output_ids, dtype=torch.int64), minlength=vocab)[:vocab].float()
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        return logits

    def _draw(self, logits: torch.Tensor, flat: list[tuple[SampleRow, int]]) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, (r, _) in enumerate(flat) if not r.params.greedy]
        if not random_rows:
            return tokens
        idx = torch.tensor(random_rows, dtype=torch.int64)
        params = [flat[i][0].params for i in random_rows]
        probs = filtered_probs(logits[idx], params)
        noise = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            row, seq_index = flat[i]
            gen = self.generator
            if row.params.seed is not None:
                gen = torch.Generator().manual_seed(_mix(row.params.seed, seq_index, row.num_output))
            noise[j].exponential_(generator=gen)
        # Exponential race: argmax(p / E) draws from p, one independent E per token.
        tokens[idx] = (probs / noise).argmax(dim=-1)
        return tokens


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, as a probability distribution per row."""
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    vocab = probs.shape[1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab)[None, :]
    # Keep a token while the mass *before* it is < top_p: the most likely token always survives.
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (rank < top_k[:, None]) & (before < top_p[:, None])
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    sorted_probs = sorted_probs * keep
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def _mix(seed: int, seq_index: int, position: int) -> int:
    """A 63-bit generator seed from a request seed, the output index and the token position."""
    x = (seed * 0x9E3779B97F4A7C15 + seq_index * 0xBF58476D1CE4E5B9 + position * 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    return x & (2**63 - 1)
