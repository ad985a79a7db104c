"""A PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) read and
checked against the base model: per target module its A ``[r, in]`` and B ``[out, r]`` with the
scaling (``lora_alpha / r``, or ``/ sqrt(r)`` under rsLoRA) folded into B. Anything the engine
cannot run as written (DoRA, trained biases, extra trained modules, a module it does not have, a
rank above ``--max-lora-rank``, shapes that are not the base's) is a ``LoraError`` naming it.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


Cut = Callable[[int, str, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class LoraError(ValueError):
    """An adapter that cannot be served as given (the message says why)."""


class AdapterBusy(LoraError):
    """An adapter that cannot be replaced or unloaded now: requests run under it."""


@dataclass(frozen=True)
class PeftAdapter:
    name: str
    path: Path
    rank: int  # the largest rank over its modules
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, target) -> (A [r, in], scaled B [out, r]), float32
    fingerprint: str  # of its files: a prefix-cache salt that changes when the weights do

    @property
    def key(self) -> str:
        """What the adapter's blocks are salted with: its name and its bytes."""
        return f"{self.name}@{self.fingerprint}"


def read_adapter(name: str, path: str | Path, max_rank: int, shapes: dict[tuple[int, str], tuple[int, int]],
                 cut: Cut | None = None) -> PeftAdapter:
    """The adapter at ``path``; ``shapes``: the base model's (in, out) of every (layer, target);
    ``cut``: a tensor-parallel rank's part of each (layer, target, A, B) (``Shard.lora_piece``)."""
    root = Path(path)
    config = _config(root)
    if config.get("use_dora"):
        raise LoraError(f"adapter {name!r}: DoRA adapters are not supported")
    if config.get("bias", "none") != "none":
        raise LoraError(f"adapter {name!r}: trained biases (bias={config['bias']!r}) are not supported")
    if config.get("alpha_pattern"):
        raise LoraError(f"adapter {name!r}: alpha_pattern is not supported (one lora_alpha for every module)")
    if config.get("modules_to_save"):
        raise LoraError(f"adapter {name!r}: modules_to_save {config['modules_to_save']} are not supported (LoRA layers only)")
    tensors = _tensors(root / WEIGHTS_FILE, name)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, target, part = _parse_key(key, name)
        pairs.setdefault((layer, target), {})[part] = tensor.float()
    if not pairs:
        raise LoraError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    weights, rank = {}, 0
    for (layer, target), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: layer {layer} {target} has lora_{''.join(pair)} without its other half")
        a, b = pair["A"], pair["B"]
        if (layer, target) not in shapes:
            raise LoraError(f"adapter {name!r}: the base model has no layer {layer} {target}")
        if cut is not None and a.dim() == 2 and b.dim() == 2:
            a, b = cut(layer, target, a, b)
        width, outs = shapes[(layer, target)]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != width or b.shape != (outs, r):
            raise LoraError(f"adapter {name!r}: layer {layer} {target} has A {tuple(a.shape)} and B {tuple(b.shape)}; "
                            f"the base model's {target} takes {width} inputs to {outs} outputs (is it this model's adapter?)")
        if r > max_rank:
            raise LoraError(f"adapter {name!r}: rank {r} is above --max-lora-rank {max_rank}")
        weights[(layer, target)] = (a.contiguous(), (b * _scaling(config, r)).contiguous())
        rank = max(rank, r)
    return PeftAdapter(name, root, rank, weights, _fingerprint(root))


def _config(root: Path) -> dict:
    if not root.is_dir():
        raise LoraError(f"{root}: not a directory (a LoRA adapter is a PEFT directory with {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads((root / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoraError(f"{root}: no {CONFIG_FILE} (a PEFT LoRA adapter directory has one)") from None
    except (OSError, ValueError) as err:
        raise LoraError(f"{root / CONFIG_FILE}: not readable JSON ({err})") from None
    if not isinstance(config, dict):
        raise LoraError(f"{root / CONFIG_FILE}: not a LoRA adapter (a JSON {type(config).__name__}, not an object)")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError(f"{root / CONFIG_FILE}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    if not isinstance(config.get("r"), int) or config["r"] < 1:
        raise LoraError(f"{root / CONFIG_FILE}: r must be a positive integer, got {config.get('r')!r}")
    return config


def _tensors(file: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not file.is_file():
        raise LoraError(f"adapter {name!r}: no {file.name} in {file.parent} (adapter_model.bin is not read: save with safetensors)")
    try:
        return load_file(file, device="cpu")
    except (SafetensorError, OSError) as err:
        raise LoraError(f"adapter {name!r}: {file} is not a readable safetensors file ({err})") from None


def _parse_key(key: str, name: str) -> tuple[int, str, str]:
    """``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` -> (3, "q_proj", "A")."""
    parts = key.split(".")
    try:
        at = parts.index("layers")
        layer, target, kind = int(parts[at + 1]), parts[-3], parts[-2]
    except (ValueError, IndexError):
        raise LoraError(f"adapter {name!r}: tensor {key!r} is not a decoder layer's LoRA weight") from None
    if kind not in ("lora_A", "lora_B") or parts[-1] != "weight":
        raise LoraError(f"adapter {name!r}: tensor {key!r} is not a LoRA A or B weight")
    if target not in TARGETS:
        raise LoraError(f"adapter {name!r}: {target} is not a supported target (supported: {', '.join(TARGETS)})")
    return layer, target, kind[-1]


def _scaling(config: dict, r: int) -> float:
    alpha = config.get("lora_alpha", r)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _fingerprint(root: Path) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for file in (CONFIG_FILE, WEIGHTS_FILE):
        with open(root / file, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()
