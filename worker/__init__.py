"""The worker: ``core`` (bookkeeping, no torch) -> ``runner`` (torch, reading ``source`` for the model) ->
``setup`` (how the engine is built) -> ``engine`` -> ``serve`` (Redis); docs/architecture.md maps every file.

The documented offline API is ``from pagedserve import LLM, SamplingParams``; this package keeps
``from pagedserve.worker import LLM`` working (loaded lazily, so ``pagedserve.worker.core`` imports without torch).
"""

from pagedserve.shared.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from pagedserve.worker.llm import LLM

        return LLM
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
