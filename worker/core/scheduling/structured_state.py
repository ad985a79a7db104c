"""What the scheduler needs of a structured-output constraint, without knowing the library.

A request with ``params.structured`` carries a ``Future`` of a pristine ``GrammarState`` (compiled
off the engine's loop, ``worker/runner/sampling/structured_masks.py``); it stays in the waiting queue until that is
done. When it starts, each sequence gets its own copy, advanced over any output tokens it already
has (a resumed request). Forks copy the parent's state (never shared: each child advances its
own). Preemption keeps a sequence's tokens, so its state stays valid through recompute and swap.
After each sampled token the state consumes it; a state that is stopped ends the sequence.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

from pagedserve.shared.errors import InvalidRequestError


class GrammarState(Protocol):
    def consume_token(self, token: int) -> bool: ...  # False: the token breaks the grammar
    def is_stopped(self) -> bool: ...  # the grammar is complete: nothing more may follow
    def deep_copy(self) -> "GrammarState": ...


def grammar_error(pending: Future) -> str | None:
    """Why a compiled grammar cannot be used, or None."""
    err = pending.exception()
    if err is None:
        return None
    return str(err) if isinstance(err, InvalidRequestError) else f"structured output: {err}"


def start_state(pristine: GrammarState, output_ids: list[int]) -> GrammarState:
    """A sequence's own state, advanced over the output tokens it already has."""
    state = pristine.deep_copy()
    for token in output_ids:
        state.consume_token(token)
    return state


def draft_states(state: GrammarState | None, tokens: tuple[int, ...]) -> tuple:
    """A speculative draft under a grammar: the state before each of the longest start of
    ``tokens`` the grammar accepts from ``state``, and after its last (copies, the sequence's own
    state untouched); the draft is cut to one fewer token than there are states. () without a grammar."""
    if state is None:
        return ()
    states = [state]
    for token in tokens:
        trial = states[-1].deep_copy()
        if trial.is_stopped() or not trial.consume_token(token):
            break
        states.append(trial)
    return tuple(states)
