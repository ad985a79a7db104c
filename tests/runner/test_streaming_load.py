"""The loader finishes a model unit by unit (``worker/runner/loader.py``): the embedding and head as
soon as their tensors are in, each decoder layer as soon as its last tensor is, so no more than one
unit's checkpoint-precision weights are ever held beside the finished ones (the load's peak memory);
and a CPU engine never imports triton or ``torch._dynamo`` (75 MiB resident for code it never runs)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from pagedserve.kernels.kv_format import kv_format
from pagedserve.kernels.ops import select_ops
from pagedserve.worker.runner import loader


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_each_unit_is_finished_before_the_next_is_read(zoo, monkeypatch, tmp_path, quantization):
    events: list[tuple[str, str]] = []
    read = loader.checkpoint_tensors
    finish = loader._finish_layers

    def reading(path):
        for name, load in read(path):
            events.append(("read", name))
            yield name, load

    def finishing(module, **options):
        events.append(("finish", type(module).__name__))
        return finish(module, **options)

    monkeypatch.setattr(loader, "checkpoint_tensors", reading)
    monkeypatch.setattr(loader, "_finish_layers", finishing)
    info = loader.inspect_model(zoo.path("llama-gqa"), "float32")
    ops = select_ops(torch.device("cpu"), "torch", tmp_path, kv_format("auto"))
    model = loader.load_weights(info, ops, torch.device("cpu"), quantization)

    layers = len(model.model.layers)
    finishes = [i for i, (kind, _) in enumerate(events) if kind == "finish"]
    assert [events[i][1] for i in finishes] == ["CausalLM"] + ["DecoderLayer"] * layers + ["CausalLM"]
    # The embedding (and an untied head) alone before the first finish; then each layer's tensors,
    # all of them and nothing else, before its own finish.
    assert {name for _, name in events[:finishes[0]]} <= {"model.embed_tokens.weight", "lm_head.weight"}
    for layer, (start, end) in enumerate(zip(finishes, finishes[1:-1])):
        names = [name for _, name in events[start + 1:end]]
        assert names and all(name.startswith(f"model.layers.{layer}.") for name in names), names
    assert [name for _, name in events[finishes[-2] + 1:finishes[-1]]] == ["model.norm.weight"]


@pytest.mark.parametrize("options", [{}, {"quantization": "int8", "kv_cache_dtype": "int8"}])
def test_a_cpu_engine_never_imports_triton_or_dynamo(zoo, options):
    script = (
        "import sys\n"
        "from pagedserve import LLM\n"
        "from pagedserve.shared.sampling import SamplingParams\n"
        f"llm = LLM(sys.argv[1], device='cpu', **{options!r})\n"
        "llm.generate([[1, 2, 3]], SamplingParams(temperature=0.7, max_tokens=4, logprobs=2), use_tqdm=False)\n"
        "print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(zoo.path("llama-gqa"))], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_quantized_gguf_tensors_read_in_chunks_are_gguf_s_own_dequantized(zoo, tmp_path, monkeypatch):
    from gguf import GGUFReader, dequantize

    from pagedserve.worker.source import gguf_weights
    from pagedserve.worker.source.gguf_file import open_gguf
    from tests.gguf_writer import write_gguf

    path = write_gguf(zoo.path("llama-gqa"), tmp_path / "q8.gguf", quantize="Q8_0")
    whole = {name: load() for name, load in gguf_weights.gguf_tensors(open_gguf(path))}
    monkeypatch.setattr(gguf_weights, "CHUNK_ELEMENTS", 100)  # a few rows a read: many chunks, a short last one
    chunked = {name: load() for name, load in gguf_weights.gguf_tensors(open_gguf(path))}
    assert whole.keys() == chunked.keys()
    assert all(torch.equal(whole[name], chunked[name]) for name in whole)
    table = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    assert table.tensor_type.name == "Q8_0" and table.data.shape[0] > 7
    assert torch.equal(chunked["model.embed_tokens.weight"], torch.from_numpy(dequantize(table.data, table.tensor_type)))


def test_a_checkpoint_short_of_a_layer_s_tensor_is_one_clear_error(zoo, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "short"
    shutil.copytree(zoo.path("llama-gqa"), folder)
    [shard] = sorted(folder.glob("*.safetensors"))
    tensors = load_file(shard)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    info = loader.inspect_model(folder, "float32")
    ops = select_ops(torch.device("cpu"), "torch", tmp_path / "kernels", kv_format("auto"))
    with pytest.raises(ValueError, match=r"lacks 1 weights, e.g. \['model.layers.1.mlp.down_proj.weight'\]"):
        loader.load_weights(info, ops, torch.device("cpu"), "int8")
