"""Where a model comes from, for the worker, the offline API and (through ``pagedserve gateway``)
the gateway's tokenizer: a local directory, a GGUF file (or a directory holding one and no
config), a hub id (resolved to a local snapshot), ``demo`` (the random-weight demo model, built
locally on first use), or, when none is named, the default real model (``worker/source/packaged_models.py``).
Also the context length its config gives."""

from __future__ import annotations

from pathlib import Path

from pagedserve.shared.keys import DEFAULT_MODEL_NAME, DEMO_NAME


MODEL_HELP = f"a model directory, a .gguf file, a hub id, a packaged model's name " \
             f"(qwen2.5-coder-1.5b-instruct-q4_k_m, fetched once), or {DEMO_NAME} (random weights, for tests); " \
             f"default: {DEFAULT_MODEL_NAME}, fetched once"


def max_model_len(config) -> int:
    """The longest sequence served: ``max_position_embeddings``; with dynamic NTK rope scaling,
    which stretches the positions past it, that times the scaling factor (as vLLM derives it).
    Sliding-window layers attend within their window at any length."""
    length = int(config.max_position_embeddings)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type")) == "dynamic":
        length = int(length * float(rope.get("factor") or 1.0))
    return length


def model_or_default(model: str | Path | None) -> str:
    """``model`` as given; ``demo``: the demo model's directory (built on first use); a packaged
    model's name (``worker/source/packaged_models.py``) that is not a local path: its GGUF (fetched on
    first use); None: the default model's."""
    from pagedserve.worker.source.packaged_models import DEFAULT_MODEL, packaged_model, packaged_model_file

    if model is not None and str(model) != "":
        if str(model) == DEMO_NAME:
            from pagedserve.worker.source.demo_model import demo_model_dir

            return str(demo_model_dir())
        spec = packaged_model(str(model))
        if spec is None or Path(model).expanduser().exists():
            return str(model)
        return str(packaged_model_file(spec))
    return str(packaged_model_file(DEFAULT_MODEL))


def model_dir(model: str | Path | None) -> str:
    """The local directory of ``model`` (None: the default model's; a GGUF: the directory made for it)."""
    return str(resolve_model_dir(model_or_default(model)))


class ModelNotFound(ValueError):
    """The model is neither a local directory nor a hub id that can be fetched (one clear line)."""


def resolve_model_dir(model: str | Path) -> Path:
    """A local model directory as is; a GGUF file, or a directory holding one GGUF and no config,
    as the directory made for it; anything else is a hub id, downloaded (or found) in the HF cache."""
    path = Path(model).expanduser()
    text = str(model)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").exists() or not ggufs:
            return path
        if len(ggufs) > 1:
            raise ModelNotFound(f"{text} holds {len(ggufs)} GGUF files ({', '.join(g.name for g in ggufs[:4])}): "
                                "name one of them")
        path = ggufs[0]
    if path.is_file():
        from pagedserve.worker.source.gguf_dir import gguf_model_dir
        from pagedserve.worker.source.gguf_file import GGUFError, is_gguf

        if not is_gguf(path):
            raise ModelNotFound(f"{text} is a file but not a GGUF model: pass a model directory or a .gguf file")
        try:
            return gguf_model_dir(path)
        except GGUFError as err:
            raise ModelNotFound(str(err)) from None
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
