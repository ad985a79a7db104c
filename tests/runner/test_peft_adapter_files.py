"""Reading a PEFT LoRA adapter directory on its own (``worker/runner/lora/peft_adapter.py``), no engine:
the files written here as PEFT writes them (``adapter_config.json``, ``adapter_model.safetensors``
with PEFT's key names). Each (layer, target) gives its A and its B scaled by ``lora_alpha / r`` (or
``/ sqrt(r)`` under rsLoRA); everything the engine cannot run as written is a ``LoraError`` naming
it; the fingerprint follows the bytes. test_lora.py checks the same adapters through the engine
against PEFT's merged model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pagedserve.worker.runner.lora.peft_adapter import LoraError, read_adapter

SHAPES = {(layer, target): shape for layer in range(2)
          for target, shape in (("q_proj", (8, 8)), ("v_proj", (8, 4)), ("down_proj", (16, 8)))}


def key(layer: int, target: str, part: str) -> str:
    block = "mlp" if target == "down_proj" else "self_attn"
    return f"base_model.model.model.layers.{layer}.{block}.{target}.lora_{part}.weight"


def write(root: Path, config: dict | None = None, tensors: dict | None = None, r: int = 2) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        gen = torch.Generator().manual_seed(0)
        tensors = {}
        for (layer, target), (width, outs) in SHAPES.items():
            tensors[key(layer, target, "A")] = torch.randn(r, width, generator=gen)
            tensors[key(layer, target, "B")] = torch.randn(outs, r, generator=gen)
    (root / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 8, **(config or {})}))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(root / "adapter_model.safetensors"))
    return root


def test_each_modules_a_and_its_b_scaled_by_alpha_over_r(tmp_path):
    root = write(tmp_path / "a")
    adapter = read_adapter("a", root, max_rank=4, shapes=SHAPES)
    assert adapter.name == "a" and adapter.path == root and adapter.rank == 2
    assert set(adapter.weights) == set(SHAPES)
    from safetensors.torch import load_file
    stored = load_file(root / "adapter_model.safetensors")
    for (layer, target), (a, b) in adapter.weights.items():
        assert a.dtype == b.dtype == torch.float32 and a.is_contiguous() and b.is_contiguous()
        torch.testing.assert_close(a, stored[key(layer, target, "A")], rtol=0, atol=0)
        torch.testing.assert_close(b, stored[key(layer, target, "B")] * (8 / 2), rtol=0, atol=0)
    assert adapter.key == f"a@{adapter.fingerprint}" and len(adapter.fingerprint) == 16


def test_rslora_scales_by_the_square_root_and_alpha_defaults_to_r(tmp_path):
    rs = read_adapter("rs", write(tmp_path / "rs", {"use_rslora": True}, r=4), 4, SHAPES)
    plain = read_adapter("plain", write(tmp_path / "plain", r=4), 4, SHAPES)
    a_rs, b_rs = rs.weights[(0, "q_proj")]
    _, b_plain = plain.weights[(0, "q_proj")]
    torch.testing.assert_close(b_rs, b_plain * (8 / math.sqrt(4)) / (8 / 4))
    config = {"peft_type": "LORA", "r": 4}  # no lora_alpha: PEFT's default is... r, a scaling of 1
    root = write(tmp_path / "default", r=4)
    (root / "adapter_config.json").write_text(json.dumps(config))
    _, b_one = read_adapter("d", root, 4, SHAPES).weights[(0, "q_proj")]
    torch.testing.assert_close(b_one, b_plain / 2)


def test_the_rank_is_the_largest_over_the_modules(tmp_path):
    tensors = {key(0, "q_proj", "A"): torch.ones(1, 8), key(0, "q_proj", "B"): torch.ones(8, 1),
               key(1, "v_proj", "A"): torch.ones(3, 8), key(1, "v_proj", "B"): torch.ones(4, 3)}
    adapter = read_adapter("mixed", write(tmp_path / "m", tensors=tensors, r=3), 3, SHAPES)
    assert adapter.rank == 3 and set(adapter.weights) == {(0, "q_proj"), (1, "v_proj")}
    with pytest.raises(LoraError, match=r"adapter 'mixed': rank 3 is above --max-lora-rank 2$"):
        read_adapter("mixed", tmp_path / "m", 2, SHAPES)


def test_the_fingerprint_follows_the_files_bytes(tmp_path):
    first = read_adapter("a", write(tmp_path / "a"), 4, SHAPES).fingerprint
    assert read_adapter("a", tmp_path / "a", 4, SHAPES).fingerprint == first
    write(tmp_path / "a", {"lora_dropout": 0.1})  # the config alone changed
    second = read_adapter("a", tmp_path / "a", 4, SHAPES).fingerprint
    tensors = {key(0, "q_proj", "A"): torch.ones(2, 8), key(0, "q_proj", "B"): torch.ones(8, 2)}
    third = read_adapter("a", write(tmp_path / "a", tensors=tensors), 4, SHAPES).fingerprint
    assert len({first, second, third}) == 3


def test_a_cut_gives_each_rank_its_part(tmp_path):
    seen = []

    def cut(layer, target, a, b):
        seen.append((layer, target))
        return a, b[: b.shape[0] // 2]

    halves = {shape_key: (width, outs // 2) for shape_key, (width, outs) in SHAPES.items()}
    adapter = read_adapter("a", write(tmp_path / "a"), 4, halves, cut)
    assert sorted(seen) == sorted(SHAPES) and adapter.weights[(0, "down_proj")][1].shape == (4, 2)


@pytest.mark.parametrize("config,message", [
    ({"use_dora": True}, "adapter 'x': DoRA adapters are not supported"),
    ({"bias": "all"}, "adapter 'x': trained biases (bias='all') are not supported"),
    ({"bias": "lora_only"}, "adapter 'x': trained biases (bias='lora_only') are not supported"),
    ({"alpha_pattern": {"q_proj": 16}}, "adapter 'x': alpha_pattern is not supported (one lora_alpha for every module)"),
    ({"modules_to_save": ["lm_head"]}, "adapter 'x': modules_to_save ['lm_head'] are not supported (LoRA layers only)"),
])
def test_what_the_engine_cannot_run_as_written_is_refused_by_name(tmp_path, config, message):
    with pytest.raises(LoraError) as caught:
        read_adapter("x", write(tmp_path / "x", config), 4, SHAPES)
    assert str(caught.value) == message


def test_empty_falsy_options_and_a_rank_of_one_are_accepted(tmp_path):
    config = {"use_dora": False, "bias": "none", "alpha_pattern": {}, "modules_to_save": None, "peft_type": "lora"}
    assert read_adapter("x", write(tmp_path / "x", config), 4, SHAPES).rank == 2
    assert read_adapter("one", write(tmp_path / "one", r=1), 4, SHAPES).rank == 1


def test_a_directory_that_is_not_an_adapter_is_refused_by_name(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(LoraError) as caught:
        read_adapter("x", missing, 4, SHAPES)
    assert str(caught.value) == (f"{missing}: not a directory (a LoRA adapter is a PEFT directory with "
                                 "adapter_config.json and adapter_model.safetensors)")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(LoraError) as caught:
        read_adapter("x", empty, 4, SHAPES)
    assert str(caught.value) == f"{empty}: no adapter_config.json (a PEFT LoRA adapter directory has one)"
    (empty / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoraError, match=r"adapter_config.json: not readable JSON \("):
        read_adapter("x", empty, 4, SHAPES)
    for config, why in (({"peft_type": "PREFIX_TUNING", "r": 2}, "peft_type 'PREFIX_TUNING'"),
                        ([1, 2], "a JSON list, not an object")):  # a list was an AttributeError before
        (empty / "adapter_config.json").write_text(json.dumps(config))
        with pytest.raises(LoraError) as caught:
            read_adapter("x", empty, 4, SHAPES)
        assert str(caught.value) == f"{empty / 'adapter_config.json'}: not a LoRA adapter ({why})"
    for r in (0, "2", None):
        (empty / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r}))
        with pytest.raises(LoraError) as caught:
            read_adapter("x", empty, 4, SHAPES)
        assert str(caught.value) == f"{empty / 'adapter_config.json'}: r must be a positive integer, got {r!r}"
    (empty / "adapter_config.json").write_text(json.dumps({"r": 2}))  # no peft_type: LoRA
    with pytest.raises(LoraError) as caught:
        read_adapter("x", empty, 4, SHAPES)
    assert str(caught.value) == (f"adapter 'x': no adapter_model.safetensors in {empty} "
                                 "(adapter_model.bin is not read: save with safetensors)")
    (empty / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoraError, match=r"^adapter 'x': .*adapter_model.safetensors is not a readable safetensors file \("):
        read_adapter("x", empty, 4, SHAPES)


@pytest.mark.parametrize("tensors,message", [
    ({}, "adapter 'x': adapter_model.safetensors holds no LoRA weights"),
    ({"base_model.model.lm_head.weight": torch.ones(2, 2)},
     "adapter 'x': tensor 'base_model.model.lm_head.weight' is not a decoder layer's LoRA weight"),
    ({"base_model.model.model.layers.x.self_attn.q_proj.lora_A.weight": torch.ones(2, 8)},
     "adapter 'x': tensor 'base_model.model.model.layers.x.self_attn.q_proj.lora_A.weight' is not a decoder layer's LoRA weight"),
    ({"base_model.model.model.layers": torch.ones(2, 8)},
     "adapter 'x': tensor 'base_model.model.model.layers' is not a decoder layer's LoRA weight"),
    ({"base_model.model.model.layers.0.self_attn.q_proj.lora_embedding_A.weight": torch.ones(2, 8)},
     "adapter 'x': tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_embedding_A.weight' is not a LoRA A or B weight"),
    ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.bias": torch.ones(2)},
     "adapter 'x': tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.bias' is not a LoRA A or B weight"),
    ({"base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight": torch.ones(2, 8)},
     "adapter 'x': qkv_proj is not a supported target (supported: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"),
    ({key(0, "q_proj", "A"): torch.ones(2, 8)}, "adapter 'x': layer 0 q_proj has lora_A without its other half"),
    ({key(0, "q_proj", "B"): torch.ones(8, 2)}, "adapter 'x': layer 0 q_proj has lora_B without its other half"),
    ({key(5, "q_proj", "A"): torch.ones(2, 8), key(5, "q_proj", "B"): torch.ones(8, 2)},
     "adapter 'x': the base model has no layer 5 q_proj"),
    ({key(0, "q_proj", "A"): torch.ones(2, 6), key(0, "q_proj", "B"): torch.ones(8, 2)},
     "adapter 'x': layer 0 q_proj has A (2, 6) and B (8, 2); the base model's q_proj takes 8 inputs to 8 outputs "
     "(is it this model's adapter?)"),
    ({key(0, "q_proj", "A"): torch.ones(2, 8), key(0, "q_proj", "B"): torch.ones(8, 3)},
     "adapter 'x': layer 0 q_proj has A (2, 8) and B (8, 3); the base model's q_proj takes 8 inputs to 8 outputs "
     "(is it this model's adapter?)"),
    ({key(0, "q_proj", "A"): torch.ones(2, 8), key(0, "q_proj", "B"): torch.ones(7, 2)},
     "adapter 'x': layer 0 q_proj has A (2, 8) and B (7, 2); the base model's q_proj takes 8 inputs to 8 outputs "
     "(is it this model's adapter?)"),
    ({key(0, "q_proj", "A"): torch.ones(2, 8, 1), key(0, "q_proj", "B"): torch.ones(8, 2)},
     "adapter 'x': layer 0 q_proj has A (2, 8, 1) and B (8, 2); the base model's q_proj takes 8 inputs to 8 outputs "
     "(is it this model's adapter?)"),
    ({key(0, "q_proj", "A"): torch.ones(2, 8), key(0, "q_proj", "B"): torch.ones(8, 2, 1)},
     "adapter 'x': layer 0 q_proj has A (2, 8) and B (8, 2, 1); the base model's q_proj takes 8 inputs to 8 outputs "
     "(is it this model's adapter?)"),
])
def test_weights_the_engine_cannot_run_are_refused_by_name(tmp_path, tensors, message):
    with pytest.raises(LoraError) as caught:
        read_adapter("x", write(tmp_path / "x", tensors=tensors), 4, SHAPES)
    assert str(caught.value) == message
