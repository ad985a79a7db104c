"""Beam search bookkeeping for one request, step for step as transformers' ``generate(num_beams=k)``.

Each step takes the log-probabilities of the running beams, keeps the top ``2k`` continuations
(``max(2, 1 + #eos) * k``), continues the best ``k`` that did not stop, and merges the stopped ones
among the top ``k`` into the finished hypotheses with the length penalty. The engine turns the
chosen ``(parent beam, token)`` pairs into forks of the parents' sequences: the shared blocks stay
shared (copy-on-write), dropped beams free their blocks at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.worker.core.scheduling.plan import BeamStep

NEG = -1.0e9
HOST = torch.device("cpu")  # the search's bookkeeping (a few scores per beam) lives on the host


@dataclass
class BeamChoice:
    parent: int  # index of the running beam it extends
    token: int


@dataclass
class BeamState:
    width: int
    max_new_tokens: int
    length_penalty: float
    early_stopping: bool | str
    eos_token_ids: tuple[int, ...]
    running_scores: torch.Tensor = None  # [running beams]
    finished_scores: torch.Tensor = None  # [width], NEG where empty
    finished_tokens: list[list[int]] = field(default_factory=list)
    finished_flags: torch.Tensor = None  # [width] bool
    tokens: list[list[int]] = field(default_factory=list)  # generated tokens of each running beam
    improvable: bool = True
    generated: int = 0
    done: bool = False

    def __post_init__(self) -> None:
        self.running_scores = torch.zeros(1, device=HOST)
        self.finished_scores = torch.full((self.width,), NEG, device=HOST)
        self.finished_flags = torch.zeros(self.width, dtype=torch.bool, device=HOST)
        self.finished_tokens = [[] for _ in range(self.width)]
        self.tokens = [[]]

    def step(self, logits: torch.Tensor) -> list[BeamChoice]:
        """``logits`` ``[running beams, vocab]`` -> the next running beams (empty once done).

        The scores over the vocabulary and their top ``2k`` are computed on the logits' device;
        only those ``2k`` candidates come to the host."""
        k, vocab = self.width, logits.shape[1]
        running = self.running_scores.to(logits.device)
        acc = (torch.log_softmax(logits.float(), dim=-1) + running[:, None]).reshape(-1)
        keep = min(max(2, 1 + len(self.eos_token_ids)) * k, acc.numel())
        top_scores, top_index = (t.to(HOST) for t in torch.topk(acc, keep))
        parents, tokens = (top_index // vocab).tolist(), (top_index % vocab).tolist()
        length = self.generated + 1
        hits = torch.tensor([t in self.eos_token_ids or length >= self.max_new_tokens for t in tokens], device=HOST)
        candidates = [self.tokens[p] + [t] for p, t in zip(parents, tokens)]
        masked = top_scores + hits.float() * NEG
        chosen = torch.topk(masked, min(k, keep))[1].tolist()
        self._merge_finished(top_scores, hits, candidates, length)
        self.running_scores = masked[chosen]
        self.tokens = [candidates[i] for i in chosen]
        self.generated = length
        self._update_heuristic()
        self.done = not (self.improvable and not (bool(self.finished_flags.all()) and self.early_stopping is True)
                         and not bool(hits.all()))
        return [] if self.done else [BeamChoice(parents[i], tokens[i]) for i in chosen]

    def _merge_finished(self, top_scores, hits, candidates, length) -> None:
        k = self.width
        just_finished = hits & (torch.arange(len(candidates), device=HOST) < k)
        scores = top_scores / (length**self.length_penalty)
        full = bool(self.finished_flags.all()) and self.early_stopping is True
        scores = scores + float(full) * NEG + float(not self.improvable) * NEG + (~just_finished).float() * NEG
        merged_scores = torch.cat((self.finished_scores, scores))
        merged_tokens = self.finished_tokens + candidates
        merged_flags = torch.cat((self.finished_flags, just_finished))
        best = torch.topk(merged_scores, k)[1].tolist()
        self.finished_scores = merged_scores[best]
        self.finished_tokens = [merged_tokens[i] for i in best]
        self.finished_flags = merged_flags[best]

    def _update_heuristic(self) -> None:
        lp = self.length_penalty
        hypothetical = self.max_new_tokens if (self.early_stopping == "never" and lp > 0.0) else self.generated
        best_running = self.running_scores[0] / (hypothetical**lp)
        worst_finished = torch.where(self.finished_flags, self.finished_scores.min(), torch.tensor(NEG, device=HOST))
        self.improvable = self.improvable and bool((best_running > worst_finished).any())

    def results(self, n: int) -> list[tuple[list[int], float]]:
        """The ``n`` best finished hypotheses (tokens, score), best first."""
        return [(self.finished_tokens[i], float(self.finished_scores[i])) for i in range(n)]


class BeamSearcher:
    """The beam searches of every beam request in flight, stepped inside the runner.

    A request's beams may be computed over several steps (a prefill chunked under the token
    budget), so each beam's logits wait here until every live beam of its request (the plan's
    ``beam_group``) has them; then the request's ``BeamState`` takes one step. The plan's
    ``finished_request_ids`` drop what is kept for requests that ended.
    """

    def __init__(self, eos_token_ids: frozenset[int]) -> None:
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self._states: dict[str, BeamState] = {}
        self._logits: dict[str, dict[int, torch.Tensor]] = {}

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)
            self._logits.pop(request_id, None)

    def step(self, items, logits: torch.Tensor) -> dict[str, BeamStep]:
        """``items``: beam rows (``ScheduledSeq``), ``logits`` one row each -> steps of complete requests."""
        heads = {}
        for item, row in zip(items, logits):
            self._logits.setdefault(item.request_id, {})[item.seq_id] = row
            heads[item.request_id] = item
        steps = {}
        for request_id, item in heads.items():
            waiting = self._logits[request_id]
            if any(seq_id not in waiting for seq_id in item.beam_group):
                continue
            p = item.params
            state = self._states.setdefault(request_id, BeamState(
                p.beam_width, p.max_tokens, p.length_penalty, p.early_stopping,
                () if p.ignore_eos else self.eos_token_ids,
            ))
            choices = state.step(torch.stack([waiting.pop(seq_id) for seq_id in item.beam_group]))
            if state.done:
                steps[request_id] = BeamStep(results=tuple((tuple(t), s) for t, s in state.results(p.n)))
            else:
                steps[request_id] = BeamStep(choices=tuple((item.beam_group[c.parent], c.token) for c in choices))
        return steps
