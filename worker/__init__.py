"""The engine: block manager, scheduler, model runner and the offline ``LLM`` API.

``LLM`` is imported lazily so that the pure-Python parts (block manager, scheduler) load without torch.
"""

from shared.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from worker.llm import LLM

        return LLM
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
