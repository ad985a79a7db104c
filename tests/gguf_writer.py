"""Write a test model (a transformers checkpoint) as a GGUF file the way llama.cpp's converter
does, so every family the GGUF source serves can be tested without a GGUF of each on disk.

Tensor names come from the ``gguf`` package's own map (``get_tensor_name_map``), not from the
table the server reads with; what the converter changes is changed here by its rules: q/k rows
of ``llama`` files permuted for interleaved rope, Gemma norms stored plus one, experts stacked
``[E, out, in]``. transformers' GGUF reader checks this writer (tests/models/test_gguf_families.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

ARCH = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
        "gemma2": "gemma2", "gemma3_text": "gemma3", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
EXPERT_PART = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: each head's rotary halves interleaved row by row."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model_dir: Path, out: Path, *, quantize: str | None = None, name: str = "test model",
               sampling: dict[str, float] | None = None) -> Path:
    """``model_dir`` (config, tokenizer, safetensors) -> ``out``; ``quantize="Q8_0"`` stores the
    2-D weights 8-bit (the rest stays F32); ``sampling``: llama.cpp's ``general.sampling.*``
    defaults (``{"temp": 0.6}``)."""
    import gguf
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    arch = ARCH[config.model_type]
    writer = gguf.GGUFWriter(str(out), arch)
    _metadata(writer, config, name)
    _tokenizer(writer, model_dir)
    for key, value in (sampling or {}).items():
        getattr(writer, f"add_sampling_{key}")(value)
    tensors: dict[str, np.ndarray] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[[k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch][0].name],
                                     config.num_hidden_layers)
    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for hf_name, data in tensors.items():
        data = data.astype(np.float32)
        found = EXPERT.fullmatch(hf_name)
        if found:
            experts.setdefault((int(found[1]), EXPERT_PART[found[3]]), {})[int(found[2])] = data
            continue
        if config.model_type == "gemma3_text" or config.model_type == "gemma2":
            data = data + 1 if hf_name.endswith("norm.weight") else data
        if arch == "llama" and ".q_proj." in hf_name:
            data = permute(data, config.num_attention_heads)
        if arch == "llama" and ".k_proj." in hf_name:
            data = permute(data, config.num_key_value_heads)
        if hf_name.endswith("shared_expert_gate.weight"):
            data = data.reshape(-1)
        base, suffix = hf_name.rsplit(".", 1)
        target = names.get_name(base)
        assert target is not None, f"gguf has no name for {hf_name}"
        _add(writer, f"{target}.{suffix}", data, quantize)
    for (layer, part), by_expert in sorted(experts.items()):
        stacked = np.stack([by_expert[e] for e in range(len(by_expert))])
        _add(writer, f"blk.{layer}.ffn_{part}_exps.weight", stacked, quantize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _add(writer, name: str, data: np.ndarray, quantize: str | None) -> None:
    import gguf

    if quantize and data.ndim >= 2 and data.shape[-1] % 32 == 0:
        kind = gguf.GGMLQuantizationType[quantize]
        writer.add_tensor(name, gguf.quantize(data, kind), raw_shape=gguf.quant_shape_to_byte_shape(data.shape, kind),
                          raw_dtype=kind)
    else:
        writer.add_tensor(name, np.ascontiguousarray(data))


def _metadata(writer, config, name: str) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    rope = getattr(config, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the file holds the global layers' base
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_rope_dimension_count(int(head_dim * float(getattr(config, "partial_rotary_factor", 1.0) or 1.0)))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if config.model_type == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _tokenizer(writer, model_dir: Path) -> None:
    """A byte-level BPE (the test models' tokenizer) as llama.cpp's ``gpt2`` tokenizer model."""
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    special = {t["content"]: t["id"] for t in spec["added_tokens"]}
    tokens = [None] * (max(list(vocab.values()) + list(special.values())) + 1)
    for text, i in {**vocab, **special}.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    settings = json.loads((model_dir / "tokenizer_config.json").read_text())
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special.values() else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    for role in ("bos", "eos", "pad"):
        token = settings.get(f"{role}_token")
        if token in special:
            getattr(writer, f"add_{role}_token_id")(special[token])
    template = model_dir / "chat_template.jinja"
    if template.exists():
        writer.add_chat_template(template.read_text())
