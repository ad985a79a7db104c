"""A GGUF as a model source: where it may be named, the model directory made for it (once, and
again when the file changes), and one clear line for every file that cannot be served."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pagedserve.worker.source.resolve import ModelNotFound, resolve_model_dir
from tests.gguf_writer import write_gguf


@pytest.fixture(scope="module")
def gguf_file(zoo, tmp_path_factory):
    return write_gguf(zoo.path("llama-gqa"), tmp_path_factory.mktemp("gguf") / "llama.gguf")


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))


def test_the_model_directory_holds_what_the_file_says(gguf_file):
    folder = resolve_model_dir(gguf_file)
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] == 2 and config["num_hidden_layers"] == 2
    assert (folder / "model.gguf").resolve() == gguf_file.resolve()
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == config["eos_token_id"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert "<|assistant|>" in tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                            add_generation_prompt=True)


def test_the_directory_is_made_once_and_again_when_the_file_changes(gguf_file, tmp_path):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(gguf_file.read_bytes())
    first = resolve_model_dir(copy)
    assert resolve_model_dir(copy) == first
    os.utime(copy, ns=(1, 1))
    assert resolve_model_dir(copy) != first


def test_sampling_defaults_come_from_the_file(zoo, tmp_path):
    from pagedserve.shared.sampling_defaults import generation_defaults

    plain = write_gguf(zoo.path("llama-gqa"), tmp_path / "plain.gguf")
    assert generation_defaults(resolve_model_dir(plain)) == {}
    sampled = write_gguf(zoo.path("llama-gqa"), tmp_path / "sampled.gguf", sampling={"temp": 0.6, "top_p": 0.9})
    assert generation_defaults(resolve_model_dir(sampled)) == {"temperature": pytest.approx(0.6), "top_p": pytest.approx(0.9)}


def test_a_directory_with_one_gguf_and_no_config_is_that_gguf(gguf_file, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "weights.gguf").write_bytes(gguf_file.read_bytes())
    assert (resolve_model_dir(folder) / "model.gguf").resolve() == (folder / "weights.gguf").resolve()
    (folder / "other.gguf").write_bytes(gguf_file.read_bytes())
    with pytest.raises(ModelNotFound, match="holds 2 GGUF files"):
        resolve_model_dir(folder)


@pytest.mark.parametrize("cut", [200, 0.6])
def test_a_truncated_file_is_one_clear_error(gguf_file, tmp_path, cut):
    data = gguf_file.read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(data[: cut if isinstance(cut, int) else int(len(data) * cut)])
    with pytest.raises(ModelNotFound, match="truncated"):
        resolve_model_dir(short)


def test_a_corrupt_or_foreign_file_is_one_clear_error(gguf_file, tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    with pytest.raises(ModelNotFound, match="not a GGUF"):
        resolve_model_dir(text)
    data = bytearray(gguf_file.read_bytes())
    data[8:16] = (2**62).to_bytes(8, "little")  # an absurd tensor count
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelNotFound, match="truncated or corrupt"):
        resolve_model_dir(bad)


def test_an_unsupported_architecture_names_the_supported_ones(tmp_path):
    import gguf

    path = tmp_path / "bert.gguf"
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelNotFound, match=r"'bert' is not supported; supported: gemma2, gemma3, llama"):
        resolve_model_dir(path)


def test_the_command_line_says_it_in_one_line(gguf_file, tmp_path):
    short = tmp_path / "short.gguf"
    short.write_bytes(gguf_file.read_bytes()[:5000])
    done = subprocess.run([sys.executable, "-m", "pagedserve.cli", "generate", "--model", str(short), "hi"],
                          capture_output=True, text=True, timeout=120, env={**os.environ})
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"pagedserve: {short} is a truncated")
