"""A model's sampling defaults: the fields of its ``generation_config.json`` that fill a request's
unset sampling parameters, read the one way the gateway (HTTP requests) and the engine (offline
``LLM``) both apply them."""

from __future__ import annotations

import json
from pathlib import Path

GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(path: str | Path, source: str = "auto") -> dict:
    """Sampling defaults from the model's ``generation_config.json`` (``source="auto"``), for the
    parameters a request leaves unset, as vLLM applies them; ``source="vllm"`` ignores the file."""
    if source not in ("auto", "vllm"):
        raise ValueError(f"generation config must be 'auto' or 'vllm', got {source!r}")
    file = Path(path) / "generation_config.json"
    if source == "vllm" or not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{file} is not readable JSON: {err}") from None
    return {k: config[k] for k in GENERATION_DEFAULTS if config.get(k) is not None}
