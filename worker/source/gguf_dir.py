"""A GGUF file as a model directory: its config, tokenizer, chat template and generation defaults
read from the file's metadata once and written beside a link to the file, in the cache. Every
part of the system that takes a model directory (the engine, the gateway's tokenizer, the
sampling defaults) then takes a GGUF unchanged; the loader reads the weights through the link
(``worker/source/gguf_weights.py``).

Config and tokenizer come from transformers' GGUF reader; ``_complete_config`` adds what it leaves
out for the families served here (a Mixtral's experts, Gemma 2's soft caps, Gemma 3's two rope
bases, Phi-3's partial rotary, the experts' sizes of Qwen MoE). The directory is keyed by the file's path, size and modification
time, built in a temporary directory and renamed into place, so processes that start together
build it at most once each and never see half of one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import structlog

from pagedserve.worker.source.gguf_file import PLAIN_FORMATS, GGUFFile, open_gguf
from pagedserve.worker.source.model_types import CAUSAL_LM

FORMAT = 2  # bumped when what is written here changes
LINK = "model.gguf"
WEIGHTS = "weights.json"  # the block formats of the file's matrices, counted (stored_weight_types)
SAMPLING = {  # llama.cpp's general.sampling.* -> generation_config.json
    "temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "penalty_repeat": "repetition_penalty",
}


def gguf_model_dir(path: str | Path, cache_root: Path | None = None) -> Path:
    """The model directory of the GGUF file at ``path``, written on first use."""
    from pagedserve.runtime.env import cache_dir

    path = Path(path).resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{FORMAT}\0{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    root = (cache_root or cache_dir()) / "gguf"
    target = root / f"{path.stem}-{key}"
    if (target / "config.json").exists():
        return target
    gguf = open_gguf(path)
    structlog.get_logger("pagedserve.gguf").info(
        "reading the GGUF's config and tokenizer into a model directory (once per file)", file=path.name,
        directory=str(target))
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".building-"))
    try:
        _write(gguf, tmp)
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").exists():  # not another process finishing first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write(gguf: GGUFFile, out: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    folder, name = str(gguf.path.parent), gguf.path.name
    config = _complete_config(AutoConfig.from_pretrained(folder, gguf_file=name), gguf)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(_generation_config(gguf, config), indent=2) + "\n")
    counts = Counter(tensor.tensor_type.name for tensor in gguf.tensors if len(tensor.shape) >= 2)
    (out / WEIGHTS).write_text(json.dumps(dict(sorted(counts.items()))) + "\n")
    (out / LINK).symlink_to(gguf.path)


def stored_weight_types(model_dir: Path) -> dict[str, int]:
    """How many matrices of each block format a GGUF model directory's file stores (``{"Q4_K": 197,
    "Q6_K": 29}``); empty for any other model directory."""
    found = model_dir / WEIGHTS
    return json.loads(found.read_text()) if found.is_file() else {}


def quantized_formats(model_dir: Path) -> list[str]:
    """The quantized block formats among a model directory's matrices (none for a float model)."""
    return sorted(set(stored_weight_types(model_dir)) - PLAIN_FORMATS)


def _complete_config(config, gguf: GGUFFile):
    """transformers' config plus the metadata its GGUF reader does not map for our families."""
    if gguf.family == "mixtral":
        from transformers import MixtralConfig

        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        config = MixtralConfig(**fields, num_local_experts=gguf.value("llama.expert_count"),
                               num_experts_per_tok=gguf.value("llama.expert_used_count"))
    if gguf.family in ("qwen2_moe", "qwen3_moe"):
        _set(config, "moe_intermediate_size", gguf.value("{arch}.expert_feed_forward_length"))
        _set(config, "shared_expert_intermediate_size", gguf.value("{arch}.expert_shared_feed_forward_length"))
    if gguf.family == "gemma2":
        _set(config, "attn_logit_softcapping", gguf.value("gemma2.attn_logit_softcapping"))
        _set(config, "final_logit_softcapping", gguf.value("gemma2.final_logit_softcapping"))
    if gguf.family in ("gemma2", "gemma3_text"):
        config.query_pre_attn_scalar = config.head_dim  # llama.cpp scales by the head size
    rope = getattr(config, "rope_parameters", None) or {}
    if gguf.family == "gemma3_text" and "sliding_attention" in rope:  # the file's base is the global layers'
        rope["full_attention"]["rope_theta"] = gguf.value("gemma3.rope.freq_base", 1_000_000.0)
        rope["sliding_attention"]["rope_theta"] = gguf.value("gemma3.rope.freq_base_swa", 10_000.0)
    if gguf.family == "phi3":
        rotary = gguf.value("phi3.rope.dimension_count")
        head_dim = config.hidden_size // config.num_attention_heads
        if rotary:
            config.partial_rotary_factor = rotary / head_dim
            if getattr(config, "rope_parameters", None) is not None:  # where transformers 5 reads it
                config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": rotary / head_dim}
    if config.model_type in CAUSAL_LM:
        config.architectures = [CAUSAL_LM[config.model_type]]
    return config


def _set(config, field: str, value) -> None:
    if value is not None:
        setattr(config, field, value)


def _generation_config(gguf: GGUFFile, config) -> dict:
    """EOS as llama.cpp stops: the end-of-sequence, end-of-turn and end-of-message tokens; sampling
    defaults from ``general.sampling.*`` where the file has them."""
    ends = [gguf.value(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    ends = list(dict.fromkeys(int(e) for e in ends if e is not None))
    out = {"bos_token_id": config.bos_token_id, "eos_token_id": ends[0] if len(ends) == 1 else ends,
           "pad_token_id": config.pad_token_id}
    for key, field in SAMPLING.items():
        value = gguf.value(f"general.sampling.{key}")
        if value is not None:
            out[field] = value
    return {k: v for k, v in out.items() if v is not None and v != []}
