"""Load a Llama-family model and its tokenizer from a local directory or a hub id.

Config and tokenizer come through transformers (``AutoConfig``, ``AutoTokenizer``), weights from
the safetensors files, by name, straight into the paged model. A hub id is resolved to a local
snapshot first, so both take the same path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from shared.model_source import max_model_len, resolve_model_dir
from kernels.ops import AttentionOps
from worker.runner.models.llama import LlamaArch, LlamaForCausalLM
from worker.runner.prepack import fast_cpu_linears

ARCHITECTURES = {
    "LlamaForCausalLM": LlamaArch(qkv_bias=False, qk_norm=False),
    "MistralForCausalLM": LlamaArch(qkv_bias=False, qk_norm=False),
    "Qwen2ForCausalLM": LlamaArch(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": LlamaArch(qkv_bias=False, qk_norm=True),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    config: object
    arch: LlamaArch
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: frozenset[int]


def inspect_model(model: str | Path, dtype: str | torch.dtype = "auto") -> ModelInfo:
    from transformers import AutoConfig

    path = resolve_model_dir(model)
    config = AutoConfig.from_pretrained(path)
    names = list(getattr(config, "architectures", None) or [])
    arch = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {names or config.model_type!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    return ModelInfo(path, config, arch, _resolve_dtype(dtype, config), max_model_len(config), _eos_ids(path, config))


def _resolve_dtype(dtype: str | torch.dtype, config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        found = str(found).replace("torch.", "") if found else "float32"
        return DTYPES.get(found, torch.float32)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def _eos_ids(path: Path, config) -> frozenset[int]:
    """EOS ids as ``generate`` sees them: generation_config.json first, then the model config."""
    ids = None
    gen = path / "generation_config.json"
    if gen.exists():
        ids = json.loads(gen.read_text()).get("eos_token_id")
    if ids is None:
        ids = getattr(config, "eos_token_id", None)
    if ids is None:
        return frozenset()
    return frozenset([ids] if isinstance(ids, int) else ids)


def load_weights(info: ModelInfo, ops: AttentionOps, device: torch.device) -> LlamaForCausalLM:
    """Build the model without initialising it, then fill every parameter from safetensors."""
    with torch.device("meta"):
        model = LlamaForCausalLM(info.config, info.arch, ops)
    expected = set(model.state_dict())
    files = sorted(info.path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {info.path}")
    state: dict[str, torch.Tensor] = {}
    # disable=None: a bar only on a terminal, never interleaved with a service's JSON log lines
    with tqdm(total=len(expected), desc="loading weights", unit="tensor", leave=False, disable=None) as bar:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name in expected:
                        state[name] = f.get_tensor(name).to(device=device, dtype=info.dtype)
                        bar.update(1)
    if model.tie_word_embeddings:
        expected.discard("lm_head.weight")
        state.pop("lm_head.weight", None)
    missing = sorted(expected - state.keys())
    if missing:
        raise ValueError(f"checkpoint {info.path} lacks {len(missing)} weights, e.g. {missing[:3]}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    model.rotary = type(model.rotary)(info.config, model.head_dim).to(device)  # buffers were on meta
    fast_cpu_linears(model, device, info.dtype)
    return model.eval()
