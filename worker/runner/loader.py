"""Load a model of a supported family (``worker/runner/models/families.py``) and its tokenizer from
a local directory, a hub id or a GGUF file.

Config and tokenizer come through transformers (``AutoConfig``, ``AutoTokenizer``), weights from
the safetensors shards or the GGUF's tensors (dequantized, under checkpoint names), by name (the
family's ``rename`` maps checkpoint names; per-expert tensors are stacked), straight into the paged
model. A hub id is resolved to a local snapshot first and a GGUF to a model directory
(``worker/source/gguf_dir.py``), so all take the same path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import structlog
import torch
from torch import nn
from tqdm.auto import tqdm

from pagedserve.kernels.native_layer_ops import GGUF_X8_TYPES
from pagedserve.kernels.ops import AttentionOps
from pagedserve.worker.runner.cpu.fused_projections import fuse_projections, use_layer_kernels
from pagedserve.worker.runner.cpu.gguf_linear import StoredForm
from pagedserve.worker.runner.load_progress import LoadProgress
from pagedserve.worker.runner.cpu.native_stack import NativeStack
from pagedserve.worker.runner.cpu.prepack import bf16_in_hardware, fast_cpu_linears
from pagedserve.worker.runner.cpu.quantized_linear import quantize_linears
from pagedserve.worker.runner.models.families import FAMILIES, Family, Fused
from pagedserve.worker.runner.models.layers import CausalLM
from pagedserve.worker.runner.parallel.shard import Shard
from pagedserve.worker.source.gguf_dir import quantized_formats
from pagedserve.worker.source.checkpoint_files import checkpoint_tensors
from pagedserve.worker.source.model_types import CAUSAL_LM, supported
from pagedserve.worker.source.resolve import max_model_len, model_or_default, resolve_model_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    config: object
    family: Family
    dtype: torch.dtype
    max_model_len: int
    eos_token_ids: frozenset[int]


def inspect_model(model: str | Path | None, dtype: str | torch.dtype = "auto") -> ModelInfo:
    from transformers import AutoConfig

    path = resolve_model_dir(model_or_default(model))
    config = AutoConfig.from_pretrained(path)
    names = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None or (names and CAUSAL_LM[model_type] not in names):
        raise UnsupportedModelError(
            f"unsupported model {config.model_type!r} ({', '.join(names) or 'no architectures'}); supported: {supported()}"
        )
    return ModelInfo(path, config, family, _resolve_dtype(dtype, config, path), max_model_len(config),
                     _eos_ids(path, config))


def _resolve_dtype(dtype: str | torch.dtype, config, path: Path) -> torch.dtype:
    """``auto``: the config's dtype; for a quantized GGUF (which names none) bfloat16 where the CPU
    multiplies bf16 in hardware (the weights run as stored, the activations at bf16), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto" and quantized_formats(path):
        return torch.bfloat16 if bf16_in_hardware() else torch.float32
    if dtype == "auto":
        found = getattr(config, "dtype", None) if hasattr(config, "dtype") else getattr(config, "torch_dtype", None)
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


def weight_form(quantization: str, info: ModelInfo, device: torch.device, ops: AttentionOps,
                shard: Shard | None = None) -> str:
    """``--quantization`` resolved: ``auto`` is ``gguf`` (the file's quantized blocks run as stored,
    ``worker/runner/cpu/gguf_linear.py``) for a quantized GGUF on a CPU whose C kernels built, without
    tensor parallel; else ``none``. ``gguf`` asked where it cannot run is a clear error."""
    stored_ok = bool(quantized_formats(info.path)) and device.type == "cpu" and ops.layer is not None and shard is None
    if quantization == "auto":
        return "gguf" if stored_ok else "none"
    if quantization == "gguf" and not stored_ok:
        raise ValueError("--quantization gguf runs a quantized GGUF file's blocks as stored, on a CPU with the C kernels "
                         f"and without tensor parallel; {info.path} on {device.type} is not that: use auto or none")
    return quantization


def load_weights(info: ModelInfo, ops: AttentionOps, device: torch.device, quantization: str = "auto",
                 shard: Shard | None = None, gguf_activations: str = "int16") -> CausalLM:
    """Build the model without initialising it, then fill every parameter from the checkpoint;
    ``quantization`` (``weight_form``): ``gguf``, a GGUF's quantized matrices kept in their blocks and
    run as stored (``worker/runner/cpu/gguf_linear.py``); ``int8``/``int4``, the linear layers' weights
    quantized (``worker/runner/cpu/quantized_linear.py``); ``shard``: only this tensor-parallel rank's
    slice of each (``worker/runner/parallel/shard.py``), read alone from safetensors. ``gguf_activations``:
    what the ``gguf`` form's row kernel takes its input at (``int16``, or ``int8`` where it runs).

    Each decoder layer takes its final form (projections fused, quantized or laid out for the CPU
    kernels) as soon as its last tensor arrives, and its checkpoint-precision weights go: at most one
    unit is held twice, never the whole model (SmolLM2-135M int8: a load peak of 1,527 -> 606-640 MiB,
    docs/engine.md)."""
    if shard is not None:
        shard.check(info.config)
    quantization = weight_form(quantization, info, device, ops, shard)
    model, full_shapes = _on_meta(info, ops, shard)
    if quantization != "none" and device.type != "cpu":
        quantize_linears(model, quantization, device)  # the clear error, before any weight is read
    expected = set(full_shapes) - ({"lm_head.weight"} if model.tie_word_embeddings else set())
    finish = partial(_finish_layers, ops=ops, device=device, dtype=info.dtype, quantization=quantization)
    layers = _LayerTracker(model, expected, finish)
    stored = StoredForm(ops.layer, info.dtype, gguf_activations == "int8") if quantization == "gguf" else None
    _put_checkpoint(info, layers, full_shapes, expected, shard, device, stored)
    missing = sorted(expected - layers.loaded)
    if missing:
        raise ValueError(f"checkpoint {info.path} lacks {len(missing)} weights, e.g. {missing[:3]}")
    model.rotary = type(model.rotary)(info.config, model.head_dim).to(device)  # buffers were on meta
    quantized, form = layers.finish_all()
    if shard is None:  # the C stack runs whole layers: a rank's need a sum across ranks inside each
        model.native_stack = NativeStack.of(model, ops.layer, ops.kv_format.quantized)  # last: it holds the modules
    log = structlog.get_logger("pagedserve.loader")
    if stored is not None and stored.dequantized:
        log.warning("no kernel runs these GGUF formats as stored: dequantized to the model's dtype",
                    formats=dict(sorted(stored.dequantized.items())), dtype=str(info.dtype).replace("torch.", ""))
    if stored is not None and stored.int8_inputs and not ops.layer.gguf_x8_runs(GGUF_X8_TYPES[0]):
        log.warning("--gguf-activations int8 needs a CPU with AVX-512 VNNI: the GGUF matrices take int16 inputs here")
    log.info("linear layers", form=form, quantization=quantization, quantized_layers=quantized,
             stored_as_file=stored.kept if stored is not None else 0, decode_stack=model.native_stack is not None)
    return model.eval()


def _on_meta(info: ModelInfo, ops: AttentionOps, shard: Shard | None) -> tuple[CausalLM, dict[str, tuple[int, ...]]]:
    """The model built on the meta device (no memory, nothing initialised), a rank's part of it under
    tensor parallel, and the whole model's parameter shapes (how a checkpoint's fused tensors split)."""
    family = info.family
    with torch.device("meta"):
        model = family.model(info.config if shard is None else shard.rank_config(info.config), family.arch, ops,
                             family.feed_forward)
        return model, _shapes(model if shard is None else family.model(info.config, family.arch, ops, family.feed_forward))


def _put_checkpoint(info: ModelInfo, layers: _LayerTracker, full_shapes: dict[str, tuple[int, ...]],
                    expected: set[str], shard: Shard | None, device: torch.device,
                    stored: StoredForm | None = None) -> None:
    """Every checkpoint tensor the model expects (``expected``) into ``layers`` (this rank's part of
    each, under tensor parallel), at the model's dtype on ``device``: fused tensors split by their
    parts' sizes, the experts' matrices stacked once all are read; with ``stored``, the matrices it
    runs as stored become their modules instead."""
    family = info.family
    read = _whole if shard is None else partial(shard.piece, config=info.config)  # (name, load) -> this rank's tensor
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    # disable=None: a bar only on a terminal, never interleaved with a service's JSON log lines
    with tqdm(total=len(expected), desc="loading weights", unit="tensor", leave=False, disable=None) as shown:
        bar = LoadProgress(shown, len(expected))
        for name, load in checkpoint_tensors(info.path):
            target = family.rename(name)
            if isinstance(target, tuple):  # one expert's matrix: stacked below
                prefix, expert, part = target
                experts.setdefault((prefix, part), {})[expert] = load() if shard is None else shard.expert_piece(part, load())
            elif isinstance(target, Fused):  # several parameters in one tensor: split by their sizes
                pieces = load().split([full_shapes[t][0] for t in target.targets], dim=0)
                for part, piece in zip(target.targets, pieces):
                    layers.put(part, read(part, partial(_same, piece)).to(device=device, dtype=info.dtype))
                    bar.update(1)
            elif target in expected:
                module = stored.module(layers.model, target, load) if stored is not None else None
                if module is not None:
                    layers.put_module(target, module)
                else:
                    layers.put(target, read(target, load).to(device=device, dtype=info.dtype))
                bar.update(1)
        for name, tensor in _stack_experts(experts, device, info.dtype).items():
            layers.put(name, tensor)


class _LayerTracker:
    """Fills the model a tensor at a time and hands each unit to ``finish`` once all of its tensors
    are in: each decoder layer, and the embedding with the head (tied to it first where the model
    ties them); ``finish_all``: the units still waiting, then whatever else the model holds."""

    ROOT = "embedding and head"

    def __init__(self, model: CausalLM, expected: set[str], finish: Callable[[nn.Module], tuple[int, str]]) -> None:
        self.model, self.finish = model, finish
        self.loaded: set[str] = set()
        self.quantized, self.form = 0, "plain"
        self.waiting = {f"model.layers.{i}.": {n for n in expected if n.startswith(f"model.layers.{i}.")}
                        for i in range(len(model.model.layers))}
        self.waiting[self.ROOT] = {n for n in expected if n.startswith(("model.embed_tokens.", "lm_head."))}

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """The tensor ``name`` assigned to the module that owns it (that module's own load, not the
        whole model's: a load from the root walks every module for each tensor, 42,891 module visits
        for the 1.5B's 141 plain tensors)."""
        owner, _, leaf = name.rpartition(".")
        try:
            module = self.model.get_submodule(owner)
        except AttributeError:  # not a module of the model: ignored, as a load with strict=False ignores it
            module, leaf = self.model, name
        module.load_state_dict({leaf: tensor}, strict=False, assign=True)
        self._arrived(name)

    def put_module(self, name: str, module: nn.Module) -> None:
        """The weight ``name`` arrives as the module that owns it (``StoredForm``)."""
        parent, _, child = name.removesuffix(".weight").rpartition(".")
        setattr(self.model.get_submodule(parent), child, module)
        self._arrived(name)

    def _arrived(self, name: str) -> None:
        self.loaded.add(name)
        unit = self._unit(name)
        remaining = self.waiting.get(unit)
        if remaining is not None:
            remaining.discard(name)
            if not remaining:
                self._finish_unit(unit)

    def finish_all(self) -> tuple[int, str]:
        """Finish every unit not yet finished, then the model itself; how many layers were
        quantized and the form its float linear layers took."""
        for unit in list(self.waiting):
            self._finish_unit(unit)
        self._finish(self.model)
        return self.quantized, self.form

    def _unit(self, name: str) -> str | None:
        if name.startswith("model.layers."):
            return name[:name.index(".", len("model.layers.")) + 1]
        return self.ROOT if name.startswith(("model.embed_tokens.", "lm_head.")) else None

    def _finish_unit(self, unit: str) -> None:
        del self.waiting[unit]
        if unit != self.ROOT:
            self._finish(self.model.get_submodule(unit.rstrip(".")))
            return
        # The embedding and head: the decoder layers set aside meanwhile (those not yet loaded are on meta).
        self.model.tie_weights()
        layers, self.model.model.layers = self.model.model.layers, nn.ModuleList()
        try:
            self._finish(self.model)
        finally:
            self.model.model.layers = layers

    def _finish(self, module: nn.Module) -> None:
        quantized, form = self.finish(module)
        self.quantized += quantized
        self.form = form if form != "plain" else self.form
        _return_freed_memory()  # the unit's checkpoint weights, freed inside the heap, go back now


def _finish_layers(module: nn.Module, ops: AttentionOps, device: torch.device, dtype: torch.dtype,
                   quantization: str) -> tuple[int, str]:
    """Give ``module``'s layers their final form, in place: projections fused and the C layer kernels
    handed over on the CPU, the linear layers quantized, the float ones laid out for this CPU.
    Modules already finished are left as they are. How many were quantized, and the float form."""
    if device.type == "cpu":
        fuse_projections(module)
        use_layer_kernels(module, ops.layer)
    quantized = quantize_linears(module, quantization, device, ops.layer)
    return quantized, fast_cpu_linears(module, device, dtype, kernels=ops.layer) or "plain"


def _return_freed_memory() -> None:
    """Hand the checkpoint's freed tensors back to the OS (glibc keeps freed heap pages): after
    quantizing or prepacking, the full-precision copies are gone but still counted in the RSS
    (measured on SmolLM2 int8: 1,074 -> 662 MiB). A no-op where there is no glibc."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _shapes(model: nn.Module) -> dict[str, torch.Size]:
    return {name: tensor.shape for name, tensor in model.state_dict().items()}


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _whole(name: str, load: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A checkpoint tensor read whole (no tensor parallel)."""
    return load()


def _stack_experts(parts: dict[tuple[str, str], dict[int, torch.Tensor]], device: torch.device,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down matrices -> ``<prefix>.gate_up_proj`` ``[E, 2I, H]`` and
    ``<prefix>.down_proj`` ``[E, H, I]``."""
    def stacked(prefix: str, part: str) -> torch.Tensor:
        by_expert = parts[(prefix, part)]
        if sorted(by_expert) != list(range(len(by_expert))):
            raise ValueError(f"checkpoint experts of {prefix} are not 0..{len(by_expert) - 1}")
        return torch.stack([by_expert[e] for e in range(len(by_expert))]).to(device=device, dtype=dtype)

    out = {}
    for prefix in sorted({prefix for prefix, _ in parts}):
        out[f"{prefix}.gate_up_proj"] = torch.cat([stacked(prefix, "gate"), stacked(prefix, "up")], dim=1)
        out[f"{prefix}.down_proj"] = stacked(prefix, "down")
    return out
