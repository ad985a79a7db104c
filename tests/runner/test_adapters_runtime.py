"""The LoRA adapters at run time (``worker/runner/lora/adapters.py``, ``lora_linear.py``), on a zoo
model's real layers without an engine: each row of a step gets its own adapter's update on every
layer the adapter targets (fused q/k/v and gate/up included, each part in its place) and the base
model's rows nothing, on the grouped batched products and through a per-row kernel; the step's
grouping written out; matrices stacked per step, kept while the same adapters share the steps, at
most ``max_loras`` on the device; a name read again serves its new bytes; every refusal whole.
test_lora.py checks the same against PEFT's merged model through the engine."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import structlog
import torch
from safetensors.torch import save_file

from pagedserve.kernels.kv_format import kv_format
from pagedserve.kernels.ops import select_ops
from pagedserve.worker.runner import loader
from pagedserve.worker.runner.lora.adapters import Adapters
from pagedserve.worker.runner.lora.lora_linear import LoraLinear
from pagedserve.worker.runner.lora.peft_adapter import LoraError

CPU = torch.device("cpu")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class Item:  # what prepare reads of a scheduled row
    adapter: str | None
    num_tokens: int


def load_model(zoo, tmp_path, fused: bool = True):
    """llama-gqa's layers as the CPU loads them (q/k/v and gate/up fused), or as a GPU keeps them
    (one matrix each: built as the loader builds it, random weights)."""
    info = loader.inspect_model(zoo.path("llama-gqa"), "float32")
    ops = select_ops(CPU, "torch", tmp_path, kv_format("auto"))
    if fused:
        return loader.load_weights(info, ops, CPU)
    model, _ = loader._on_meta(info, ops, None)
    model = model.to_empty(device=CPU)
    gen = torch.Generator().manual_seed(5)
    for parameter in model.parameters():
        parameter.data.copy_(torch.randn(parameter.shape, generator=gen) * 0.1)
    return model


@pytest.fixture
def model(zoo, tmp_path):
    return load_model(zoo, tmp_path)


def target_shapes(config) -> dict[tuple[int, str], tuple[int, int]]:
    """Each (layer, PEFT target)'s (in, out), from the model's config alone."""
    hidden, head = config.hidden_size, config.hidden_size // config.num_attention_heads
    nq, nk, inter = config.num_attention_heads * head, config.num_key_value_heads * head, config.intermediate_size
    shapes = {"q_proj": (hidden, nq), "k_proj": (hidden, nk), "v_proj": (hidden, nk), "o_proj": (nq, hidden),
              "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    return {(layer, t): shape for layer in range(config.num_hidden_layers) for t, shape in shapes.items()}


def places(config, fused: bool) -> dict[tuple[int, str], tuple[str, int]]:
    """Where each (layer, target)'s update lands: the wrapped module's key and its first output
    column (fused: q, k, v side by side in ``qkv``, gate and up in ``gate_up``)."""
    shapes = target_shapes(config)
    out = {}
    for (layer, target), _ in shapes.items():
        if fused and target in ("q_proj", "k_proj", "v_proj"):
            before = {"q_proj": 0, "k_proj": 1, "v_proj": 2}[target]
            at = sum(shapes[(layer, t)][1] for t in ("q_proj", "k_proj", "v_proj")[:before])
            out[(layer, target)] = (f"{layer}.qkv", at)
        elif fused and target in ("gate_proj", "up_proj"):
            out[(layer, target)] = (f"{layer}.gate_up", 0 if target == "gate_proj" else shapes[(layer, "gate_proj")][1])
        else:
            out[(layer, target)] = (f"{layer}.{target}", 0)
    return out


def write_adapter(root: Path, shapes: dict, rank: int, targets: tuple[str, ...], seed: int) -> Path:
    """PEFT's files for ``targets`` of every layer (alpha 2r: B scaled by 2)."""
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for (layer, target), (width, outs) in shapes.items():
        if target in targets:
            block = "self_attn" if target in ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, width, generator=gen)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(outs, rank, generator=gen)
    (root / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}))
    save_file(tensors, str(root / "adapter_model.safetensors"))
    return root


def wrapped(model) -> dict[str, LoraLinear]:
    return {m.key: m for m in model.modules() if isinstance(m, LoraLinear)}


def expected(adapters: Adapters, module: LoraLinear, x: torch.Tensor, row_adapters: list, fused: bool = True) -> torch.Tensor:
    """The base layer's output plus, on each row, that row's adapter's update of each part it
    targets in the part's own output columns (read from the adapter, not the stacked matrices)."""
    y = module.base(x).clone()
    for row, name in enumerate(row_adapters):
        if name is None:
            continue
        for (layer, target), (key, at) in places(adapters.model.config, fused).items():
            pair = adapters.loaded[name].weights.get((layer, target))
            if key == module.key and pair is not None:
                a, b = pair
                update = x[row] @ a.T @ b.T
                y[row, at:at + len(update)] += update
    return y


def per_row_kernel(y, x, a, b, slots):
    """A reference for the kernel ops' update: each token under the adapter its slot names."""
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            y[row] += x[row] @ a[slot].T @ b[slot].T
    return y


@pytest.fixture
def files(zoo, tmp_path):
    shapes = target_shapes(loader.inspect_model(zoo.path("llama-gqa"), "float32").config)
    return {"qvd": write_adapter(tmp_path / "qvd", shapes, 2, ("q_proj", "v_proj", "down_proj"), 1),
            "ogu": write_adapter(tmp_path / "ogu", shapes, 4, ("o_proj", "gate_proj", "up_proj"), 2),
            "all": write_adapter(tmp_path / "all", shapes, 3, ATTENTION + ("gate_proj", "up_proj", "down_proj"), 3)}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "one-matrix-each"])
@pytest.mark.parametrize("kernel", [None, per_row_kernel], ids=["grouped", "kernel"])
def test_each_row_gets_its_own_adapters_update_on_every_layer(zoo, tmp_path, files, kernel, fused):
    model = load_model(zoo, tmp_path, fused)
    adapters = Adapters(model, 3, 8, CPU, torch.float32, kernel=kernel)
    for name, path in files.items():
        adapters.load(name, path)
    items = [Item("qvd", 3), Item(None, 2), Item("ogu", 1), Item("qvd", 2), Item("all", 1)]
    rows = [i.adapter for i in items for _ in range(i.num_tokens)]
    adapters.prepare(items)
    modules = wrapped(model)
    assert set(modules) == {key for key, _ in places(model.config, fused).values()}
    gen = torch.Generator().manual_seed(0)
    for key, module in modules.items():
        x = torch.randn(len(rows), module.base.in_features, generator=gen)
        torch.testing.assert_close(module(x), expected(adapters, module, x, rows, fused), rtol=1e-5, atol=1e-5,
                                   msg=key)
    adapters.prepare([Item(None, 4)])  # every row the base model's again
    for module in modules.values():
        x = torch.randn(4, module.base.in_features, generator=gen)
        assert torch.equal(module(x), module.base(x))


def test_a_steps_rows_are_grouped_by_adapter_in_blocks_padded_with_their_first_row(model, files):
    adapters = Adapters(model, 2, 8, CPU, torch.float32)
    adapters.load("qvd", files["qvd"])
    adapters.load("ogu", files["ogu"])
    adapters.prepare([Item("qvd", 3), Item(None, 2), Item("ogu", 1), Item("qvd", 2)])
    step = adapters.step
    assert (step.adapters, step.width) == (2, 5)
    assert step.gather.tolist() == [5, 5, 5, 5, 5, 0, 1, 2, 6, 7]  # the adapters by name: "ogu" first
    assert step.rows.tolist() == [5, 0, 1, 2, 6, 7] and step.valid.tolist() == [0, 5, 6, 7, 8, 9]
    assert all(t.dtype == torch.int64 and t.device == CPU for t in (step.gather, step.rows, step.valid))
    adapters.prepare([Item("qvd", 2), Item("ogu", 4)])  # "qvd"'s block padded with its first row
    assert step.gather.tolist() == [2, 3, 4, 5, 0, 1, 0, 0] and step.valid.tolist() == [0, 1, 2, 3, 4, 5]
    adapters.prepare([Item("ogu", 2), Item("qvd", 2)])  # blocks of equal width: nothing to drop
    assert step.gather.tolist() == [0, 1, 2, 3] and step.rows.tolist() == [0, 1, 2, 3] and step.valid is None
    adapters.prepare([Item(None, 3)])
    assert (step.gather, step.valid, step.rows, step.slots, step.weights) == (None, None, None, None, {})


def test_with_a_kernel_each_token_names_its_adapters_place_in_the_stack(model, files):
    adapters = Adapters(model, 2, 8, CPU, torch.float32, kernel=per_row_kernel)
    adapters.load("qvd", files["qvd"])
    adapters.load("ogu", files["ogu"])
    adapters.prepare([Item("qvd", 3), Item(None, 2), Item("ogu", 1), Item("qvd", 2)])
    step = adapters.step
    assert step.slots.tolist() == [1, 1, 1, -1, -1, 0, 1, 1] and step.slots.dtype == torch.int32
    assert step.adapters == 2 and step.gather is None


def test_the_stack_pads_ranks_with_zeros_and_leaves_out_layers_no_adapter_targets(model, files):
    adapters = Adapters(model, 2, 8, CPU, torch.float32)
    adapters.load("qvd", files["qvd"])
    adapters.load("ogu", files["ogu"])
    adapters.prepare([Item("qvd", 1), Item("ogu", 1)])
    weights, widths = adapters.step.weights, adapters.widths
    layers = len(model.model.layers)
    assert set(weights) == set(widths) and len(weights) == 4 * layers  # between them, every wrapped layer
    a, b = weights["0.o_proj"]  # only "ogu" (rank 4, first in the stack) adapts o_proj
    assert a.shape == (2, 4, a.shape[2]) and b.shape == (2, widths["0.o_proj"], 4)
    assert a[0].any() and b[0].any() and not a[1].any() and not b[1].any()
    a, b = weights["0.down_proj"]  # only "qvd" (rank 2): padded to 4 with zeros
    assert a[1, :2].any() and not a[1, 2:].any() and not b[1, :, 2:].any() and not a[0].any()
    adapters.prepare([Item("qvd", 1)])
    assert set(adapters.step.weights) == {k for i in range(layers) for k in (f"{i}.qkv", f"{i}.down_proj")}


def test_the_stack_is_kept_while_the_same_adapters_share_the_steps(model, files):
    adapters = Adapters(model, 2, 8, CPU, torch.float32)
    adapters.load("qvd", files["qvd"])
    adapters.load("ogu", files["ogu"])
    adapters.prepare([Item("qvd", 1), Item("ogu", 2)])
    first = adapters.step.weights
    adapters.prepare([Item("ogu", 1), Item("qvd", 5)])
    assert adapters.step.weights is first
    adapters.prepare([Item("qvd", 1)])
    assert adapters.step.weights is not first


def on_device(adapters: Adapters) -> list[str]:
    return list(adapters._on_device)


def test_at_most_max_loras_on_the_device_least_recent_out_never_one_the_step_needs(model, files):
    adapters = Adapters(model, 2, 8, CPU, torch.float32)
    for name, path in files.items():
        adapters.load(name, path)
    adapters.prepare([Item("qvd", 1)])
    adapters.prepare([Item("ogu", 1)])
    adapters.prepare([Item("qvd", 1)])  # used again: now the most recent
    assert on_device(adapters) == ["ogu", "qvd"]
    with structlog.testing.capture_logs() as logs:
        adapters.prepare([Item("all", 1)])
        adapters.prepare([Item("all", 1), Item("qvd", 1)])  # as many as --max-loras: no warning
    assert on_device(adapters) == ["all", "qvd"] and logs == []
    with structlog.testing.capture_logs() as logs:
        adapters.prepare([Item("qvd", 1), Item("ogu", 1), Item("all", 1)])
    assert sorted(on_device(adapters)) == ["all", "ogu", "qvd"]  # the step needs all three
    assert [e for e in logs if e["event"] == "more adapters in one step than --max-loras"] == [
        {"event": "more adapters in one step than --max-loras", "step_adapters": 3, "max_loras": 2, "log_level": "warning"}]
    assert on_device(adapters) == ["all", "ogu", "qvd"]
    adapters.prepare([Item("ogu", 1)])  # back within the limit at once, the least recent out
    assert on_device(adapters) == ["qvd", "ogu"]


def test_a_name_read_again_serves_its_new_bytes(model, files):
    adapters = Adapters(model, 2, 8, CPU, torch.float32)
    first = adapters.load("x", files["qvd"])
    adapters.prepare([Item("x", 1)])
    module = wrapped(model)["0.down_proj"]
    x = torch.randn(1, module.base.in_features)
    before = module(x)
    second = adapters.load("x", files["all"])
    assert adapters.salt("x") == second.key != first.key
    adapters.prepare([Item("x", 1)])
    after = module(x)
    torch.testing.assert_close(after, expected(adapters, module, x, ["x"]), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


def test_an_unloaded_adapter_is_gone_and_its_device_copy_with_it(model, files):
    adapters = Adapters(model, 2, 8, CPU, torch.float32)
    adapters.load("qvd", files["qvd"])
    adapters.load("ogu", files["ogu"])
    adapters.prepare([Item("qvd", 1), Item("ogu", 1)])
    adapters.unload("qvd")
    assert set(adapters.loaded) == {"ogu"} and on_device(adapters) == ["ogu"]
    adapters.prepare([Item("ogu", 1)])
    assert adapters.step.adapters == 1


@pytest.mark.parametrize("name", ["", "a=b"])
def test_a_name_that_cannot_be_a_models_is_refused(model, files, name):
    adapters = Adapters(model, 2, 8, CPU, torch.float32)
    with pytest.raises(LoraError) as error:
        adapters.load(name, files["qvd"])
    assert str(error.value) == f"an adapter name must be non-empty and hold no '=', got {name!r}"
    assert adapters.loaded == {}


def test_unknown_names_are_refused_saying_what_is_loaded(model, files):
    adapters = Adapters(model, 2, 8, CPU, torch.float32)
    with pytest.raises(LoraError) as error:
        adapters.salt("x")
    assert str(error.value) == "no adapter named 'x' is loaded (loaded: none)"
    adapters.load("qvd", files["qvd"])
    adapters.load("all", files["all"])
    with pytest.raises(LoraError) as error:
        adapters.salt("x")
    assert str(error.value) == "no adapter named 'x' is loaded (loaded: all, qvd)"
    with pytest.raises(LoraError) as error:
        adapters.unload("x")
    assert str(error.value) == "no adapter named 'x' is loaded"
    assert adapters.salt("qvd") == adapters.loaded["qvd"].key


def test_an_adapter_above_the_rank_limit_is_refused_and_nothing_kept(model, files):
    adapters = Adapters(model, 2, 2, CPU, torch.float32)
    with pytest.raises(LoraError, match=r"rank 4 is above --max-lora-rank 2$"):
        adapters.load("ogu", files["ogu"])
    assert adapters.loaded == {}


def test_a_load_says_what_it_read_and_keys_the_adapter_by_its_name_and_bytes(model, files):
    adapters = Adapters(model, 2, 8, CPU, torch.float32)
    with structlog.testing.capture_logs() as logs:
        adapter = adapters.load("x", files["qvd"])
    assert logs == [{"event": "lora adapter loaded", "name": "x", "path": str(files["qvd"]), "rank": 2,
                     "modules": 3 * len(model.model.layers), "log_level": "info"}]
    assert adapter.name == "x" and adapters.salt("x") == f"x@{adapter.fingerprint}"


def test_a_tensor_parallel_ranks_cut_takes_each_matrix_pair(model, files):
    seen = []

    def cut(layer, target, a, b):
        seen.append((layer, target))
        return a[:1], b[:, :1]  # a rank's part: here, rank 1 of the adapter's 2

    adapters = Adapters(model, 2, 8, CPU, torch.float32, cut=cut)
    adapter = adapters.load("x", files["qvd"])
    layers = range(len(model.model.layers))
    assert sorted(seen) == sorted((i, t) for i in layers for t in ("q_proj", "v_proj", "down_proj"))
    assert all(a.shape[0] == 1 and b.shape[1] == 1 for a, b in adapter.weights.values())


def test_the_stacks_tensors_are_on_the_adapters_device_and_dtype_whatever_the_default_device(zoo, tmp_path, model, files):
    adapters = Adapters(model, 2, 8, CPU, torch.bfloat16)
    adapters.load("qvd", files["qvd"])
    adapters.load("ogu", files["ogu"])
    with torch.device("meta"):  # a tensor made without naming its device would land here
        adapters.prepare([Item("qvd", 2), Item(None, 1), Item("ogu", 3)])
    step = adapters.step
    assert all(t.device == CPU for t in (step.gather, step.rows, step.valid))
    assert all(a.device == b.device == CPU and a.dtype == b.dtype == torch.bfloat16 for a, b in step.weights.values())
    kernel = Adapters(load_model(zoo, tmp_path), 2, 8, CPU, torch.float32, kernel=per_row_kernel)
    kernel.load("qvd", files["qvd"])
    with torch.device("meta"):
        kernel.prepare([Item("qvd", 2)])
    assert kernel.step.slots.device == CPU
