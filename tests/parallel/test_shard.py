"""How checkpoint tensors are cut for each rank (worker/runner/parallel/shard.py): the ranks' pieces put
back together are the whole tensor (column cuts by rows, row cuts by columns, the vocabulary padded
on the last rank), a row-parallel bias is added once over the ranks, and a safetensors tensor is
read as its slice alone."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from pagedserve.worker.source.checkpoint_files import checkpoint_tensors
from pagedserve.worker.runner.parallel.shard import Shard, ShardError

CONFIG = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                     vocab_size=101, num_hidden_layers=1)
HEAD_DIM = 8


def pieces(name: str, tensor: torch.Tensor, size: int = 2) -> list[torch.Tensor]:
    return [Shard(rank, size).piece(name, lambda: tensor, CONFIG) for rank in range(size)]


@pytest.mark.parametrize("name, shape, dim", [
    ("model.layers.0.self_attn.q_proj.weight", (32, 32), 0), ("model.layers.0.self_attn.k_proj.weight", (16, 32), 0),
    ("model.layers.0.self_attn.q_proj.bias", (32,), 0), ("model.layers.0.self_attn.o_proj.weight", (32, 32), 1),
    ("model.layers.0.mlp.gate_proj.weight", (48, 32), 0), ("model.layers.0.mlp.down_proj.weight", (32, 48), 1),
])
def test_the_ranks_pieces_make_the_whole(name, shape, dim):
    whole = torch.randn(shape)
    parts = pieces(name, whole)
    assert all(p.shape[dim] == shape[dim] // 2 for p in parts)
    assert torch.equal(torch.cat(parts, dim=dim), whole)


def test_the_vocabulary_is_cut_by_rows_and_the_last_rank_padded():
    whole = torch.randn(101, 32)
    parts = pieces("model.embed_tokens.weight", whole)
    assert [len(p) for p in parts] == [51, 51]
    assert torch.equal(torch.cat(parts)[:101], whole) and not parts[1][50].any()


def test_a_row_parallel_bias_is_added_once_over_the_ranks():
    bias = torch.randn(32)
    parts = pieces("model.layers.0.self_attn.o_proj.bias", bias)
    assert torch.equal(sum(parts), bias) and not parts[1].any()
    down = pieces("model.layers.0.mlp.down_proj.bias", bias)
    assert torch.equal(down[0], bias) and not down[1].any()


def test_norms_and_other_tensors_are_whole_on_every_rank():
    norm = torch.randn(32)
    assert all(torch.equal(p, norm) for p in pieces("model.layers.0.input_layernorm.weight", norm))


def test_a_safetensors_tensor_is_read_as_the_rank_slice_alone(tmp_path):
    whole = torch.randn(48, 32)
    save_file({"model.layers.0.mlp.up_proj.weight": whole, "model.layers.0.mlp.down_proj.weight": whole.T.contiguous()},
              tmp_path / "model.safetensors")
    seen = 0
    for name, load in checkpoint_tensors(tmp_path):  # the file is open while its tensors are listed
        seen += 1
        whole_reads = []
        original = load.__call__
        load.__class__ = type("Counted", (type(load),), {"__call__": lambda self: whole_reads.append(1) or original()})
        got = Shard(1, 2).piece(name, load, CONFIG)
        assert not whole_reads, f"{name} was read whole"
        dim = 0 if "up_proj" in name else 1
        assert torch.equal(got, (whole if dim == 0 else whole.T).narrow(dim, 24, 24))
    assert seen == 2


def test_kv_heads_neither_dividing_nor_divided_are_refused():
    with pytest.raises(ShardError, match="KV heads"):
        Shard(0, 4).check(LlamaConfig(hidden_size=48, num_attention_heads=12, num_key_value_heads=3,
                                      intermediate_size=48, vocab_size=100, num_hidden_layers=1))
