"""pagedserve: LLM serving on a paged, copy-on-write KV cache.

    from pagedserve import LLM, SamplingParams

This package is the public face: the offline API, the ``pagedserve`` command, ``pagedserve up``
(a whole local stack) and the embedded Redis it starts. It is the only package that imports both
services (``worker`` and ``gateway``). ``LLM`` loads lazily, so ``SamplingParams`` needs no torch.
"""

from pagedserve.shared.sampling import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from pagedserve.worker.llm import LLM

        return LLM
    if name == "LoRARequest":
        from pagedserve.worker.runner.lora.request import LoRARequest

        return LoRARequest
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("pagedserve")
        except PackageNotFoundError:
            return "0+unknown"
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
