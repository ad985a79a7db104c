"""Facts about a model read from its Hugging Face config, shared by the gateway and the engine."""

from __future__ import annotations

from pathlib import Path


def max_model_len(config) -> int:
    """The longest sequence served: ``max_position_embeddings``, capped at a sliding window
    (sliding-window attention is not implemented, so we stay inside the window)."""
    length = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        length = min(length, int(window))
    return length


def resolve_model_dir(model: str | Path) -> Path:
    """A local directory as is; anything else is a hub id, downloaded (or found) in the HF cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    return Path(snapshot_download(str(model), allow_patterns=patterns))
