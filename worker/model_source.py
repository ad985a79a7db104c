"""Where a model comes from, for the worker, the offline API and (through ``pagedserve gateway``)
the gateway's tokenizer: a local directory, a hub id (resolved to a local snapshot), or, when none
is named, the demo model built locally on first use. Also the context length its config gives."""

from __future__ import annotations

from pathlib import Path


def max_model_len(config) -> int:
    """The longest sequence served: ``max_position_embeddings``; with dynamic NTK rope scaling,
    which stretches the positions past it, that times the scaling factor (as vLLM derives it).
    Sliding-window layers attend within their window at any length."""
    length = int(config.max_position_embeddings)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) == "dynamic":
        length = int(length * float(rope.get("factor") or 1.0))
    return length


def model_or_demo(model: str | Path | None) -> str:
    """``model`` as given, or the demo model's directory (built on first use) when it is None."""
    if model is not None and str(model) != "":
        return str(model)
    from pagedserve.worker.demo_model import demo_model_dir

    return str(demo_model_dir())


def model_dir(model: str | Path | None) -> str:
    """The local directory of ``model`` (None: the demo model's)."""
    return str(resolve_model_dir(model_or_demo(model)))


class ModelNotFound(ValueError):
    """The model is neither a local directory nor a hub id that can be fetched (one clear line)."""


def resolve_model_dir(model: str | Path) -> Path:
    """A local directory as is; anything else is a hub id, downloaded (or found) in the HF cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    text = str(model)
    if path.exists():
        raise ModelNotFound(f"{text} is a file, not a model directory")
    if text.startswith(("/", "./", "../", "~")) or text.count("/") > 1:
        raise ModelNotFound(f"no model directory at {path.resolve()}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(text, allow_patterns=patterns))
    except LocalEntryNotFoundError:
        raise ModelNotFound(f"{text} is not a local directory and the hub cannot be reached to fetch it "
                            "(no network?): pass a local model directory") from None
    except HfHubHTTPError as err:
        raise ModelNotFound(f"{text} is not a local directory and the hub refused it: {str(err).splitlines()[0]}") from None
    except ValueError as err:  # a malformed repo id
        raise ModelNotFound(f"{text} is neither a local model directory nor a hub id: {err}") from None
