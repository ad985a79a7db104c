"""What ``LLM.generate`` and ``LLM.chat`` hand back: the engine's outputs in vLLM's shapes, so a
program written for vLLM's ``LLM`` reads them unchanged.

``CompletionOutput.logprobs`` is ``list[dict[int, Logprob]]`` (one dict a generated token) and
``RequestOutput.prompt_logprobs`` ``list[dict[int, Logprob] | None]`` (None for the first prompt
token). Each dict holds the position's own token first, with its rank in the whole vocabulary, then
the top alternatives asked for, ranked 1, 2, ... by logprob; every entry carries its text
(``decoded_token``). ``RequestOutput.prompt`` is the prompt's text when it was given as text (the
templated conversation for ``chat``), None for token ids, as vLLM's. ``Engine.step`` keeps its
``SampledToken`` entries (the worker's wire events read those).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from pagedserve.worker.core.scheduling.outputs import RequestOutput
from pagedserve.worker.core.scheduling.plan import SampledToken


@dataclass(frozen=True)
class Logprob:
    """vLLM's: a token's log-probability, its rank in the vocabulary by it (1: the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def logprob_entry(token: SampledToken, piece: Callable[[int], str]) -> dict[int, Logprob]:
    """One position's entry: its token first, then the alternatives best first (the token sorts among
    them only where it is one of them, so their ranks are exact)."""
    entry = {token.token_id: Logprob(token.logprob, token.rank, piece(token.token_id))}
    alternatives = sorted((token.top_logprobs or {}).items(), key=lambda item: -item[1])
    for rank, (token_id, logprob) in enumerate(alternatives, 1):
        entry.setdefault(token_id, Logprob(logprob, rank, piece(token_id)))
    return entry


def offline_output(out: RequestOutput, prompt: str | None, piece: Callable[[int], str]) -> RequestOutput:
    """``out`` as vLLM's ``LLM`` returns it (``prompt``: the text it was asked with, if any)."""
    outputs = [o if o.logprobs is None else replace(o, logprobs=[logprob_entry(t, piece) for t in o.logprobs])
               for o in out.outputs]
    prompt_logprobs = None if out.prompt_logprobs is None else [
        None if t is None else logprob_entry(t, piece) for t in out.prompt_logprobs]
    return replace(out, prompt=prompt, outputs=outputs, prompt_logprobs=prompt_logprobs)


def prompt_token_logprobs(out: RequestOutput) -> list[float]:
    """The logprob of each prompt token after the first, read from its position's entry."""
    return [entry[token].logprob for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])]


def best_token(entry: dict[int, Logprob]) -> int | None:
    """The position's most likely token (rank 1), where the entry holds it."""
    return next((token for token, logprob in entry.items() if logprob.rank == 1), None)
