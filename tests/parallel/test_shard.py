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


def test_everything_that_does_not_divide_is_named_in_one_message():
    config = LlamaConfig(hidden_size=36, num_attention_heads=6, num_key_value_heads=3, intermediate_size=50,
                         vocab_size=100, num_hidden_layers=1)
    config.moe_intermediate_size, config.shared_expert_intermediate_size = 14, 18
    with pytest.raises(ShardError) as error:
        Shard(0, 4).check(config)
    assert str(error.value) == (
        "llama cannot be split over 4 ranks (tensor parallel): 6 attention heads; 3 KV heads (neither a multiple "
        "of the ranks nor dividing them); intermediate_size 50; moe_intermediate_size 14; "
        "shared_expert_intermediate_size 18 do not divide")


def test_olmoe_is_refused_for_its_norm_over_the_whole_projection():
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=48,
                         vocab_size=100, num_hidden_layers=1)
    config.model_type = "olmoe"
    with pytest.raises(ShardError, match=r"^olmoe cannot be split over 2 ranks .*: OLMoE's q/k norm over the whole "
                                         r"projection \(it would need a sum across ranks\) do not divide$"):
        Shard(1, 2).check(config)


@pytest.mark.parametrize("size", [1, 2, 4])
def test_a_model_that_divides_passes_with_kv_heads_split_or_replicated(size):
    Shard(0, size).check(CONFIG)  # 4 heads, 2 KV heads: split over 2, replicated over 4


def test_a_ranks_config_holds_its_slice_and_leaves_the_models_whole():
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                         vocab_size=101, num_hidden_layers=1)
    config.moe_intermediate_size, config.shared_expert_intermediate_size = 16, 20
    config.head_dim = None  # a config that leaves it to hidden_size / heads
    two, four = Shard(1, 2).rank_config(config), Shard(3, 4).rank_config(config)
    assert (two.num_attention_heads, two.num_key_value_heads, two.head_dim) == (2, 1, 8)
    assert (two.intermediate_size, two.moe_intermediate_size, two.shared_expert_intermediate_size) == (24, 8, 10)
    assert two.vocab_size == 51 and four.vocab_size == 26
    assert (four.num_attention_heads, four.num_key_value_heads) == (1, 1)  # 2 KV heads over 4 ranks: one each, replicated
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size, config.vocab_size,
            config.moe_intermediate_size) == (4, 2, 48, 101, 16)
    assert config.head_dim is None


def test_a_config_with_its_own_head_size_keeps_it():
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=48,
                         vocab_size=100, num_hidden_layers=1, head_dim=16)
    assert Shard(0, 2).rank_config(config).head_dim == 16


def test_replicated_kv_heads_go_to_the_ranks_whose_query_heads_read_them():
    whole = torch.randn(16, 32)  # 2 KV heads of 8
    parts = pieces("model.layers.0.self_attn.v_proj.weight", whole, size=4)
    assert [torch.equal(p, whole[h * 8:(h + 1) * 8]) for p, h in zip(parts, [0, 0, 1, 1])] == [True] * 4


def test_a_rank_wholly_past_the_vocabulary_holds_padding_alone():
    config = LlamaConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=2, intermediate_size=8,
                         vocab_size=5, num_hidden_layers=1)
    whole = torch.randn(5, 8)
    parts = [Shard(rank, 4).piece("lm_head.weight", lambda: whole, config) for rank in range(4)]
    assert [p.shape for p in parts] == [(2, 8)] * 4
    assert torch.equal(torch.cat(parts)[:5], whole) and not torch.cat(parts)[5:].any()


def test_a_shared_experts_matrices_are_cut_by_its_own_width():
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                         vocab_size=101, num_hidden_layers=1)
    config.shared_expert_intermediate_size = 20
    up, down = torch.randn(20, 32), torch.randn(32, 20)
    ups = [Shard(r, 2).piece("model.layers.0.mlp.shared_expert.up_proj.weight", lambda: up, config) for r in range(2)]
    downs = [Shard(r, 2).piece("model.layers.0.mlp.shared_expert.down_proj.weight", lambda: down, config) for r in range(2)]
    assert torch.equal(ups[1], up[10:]) and torch.equal(downs[1], down[:, 10:])


def test_a_name_without_a_module_is_whole_and_one_of_two_parts_is_cut_by_them():
    table = torch.randn(4)
    assert torch.equal(Shard(1, 2).piece("scale", lambda: table, CONFIG), table)
    down = torch.randn(32, 48)
    assert torch.equal(Shard(1, 2).piece("down_proj.weight", lambda: down, CONFIG), down[:, 24:])


def test_a_config_without_kv_heads_or_head_size_reads_them_from_its_heads():
    from types import SimpleNamespace

    config = SimpleNamespace(model_type="gpt", hidden_size=32, num_attention_heads=4, intermediate_size=48,
                             vocab_size=100)
    Shard(0, 2).check(config)
    rank = Shard(1, 2).rank_config(config)
    assert (rank.num_attention_heads, rank.num_key_value_heads, rank.head_dim) == (2, 2, 8)
    whole = torch.randn(32, 32)
    assert torch.equal(Shard(1, 2).piece("model.layers.0.self_attn.k_proj.weight", lambda: whole, config), whole[16:])


@pytest.mark.parametrize("target, dim", [("q_proj", 0), ("k_proj", 0), ("gate_proj", 0), ("up_proj", 0),
                                         ("o_proj", 1), ("down_proj", 1)])
def test_an_adapters_cut_follows_its_layers(target, dim):
    """Column-parallel: B by its output rows as the weight, A whole; row-parallel: A by its input
    columns, B whole. The ranks' updates put together are the whole update."""
    width_in = 48 if target == "down_proj" else 32
    width_out = {"k_proj": 16, "gate_proj": 48, "up_proj": 48}.get(target, 32)
    a, b = torch.randn(4, width_in), torch.randn(width_out, 4)
    cuts = [Shard(rank, 2).lora_piece(0, target, a, b, CONFIG) for rank in range(2)]
    if dim == 0:
        assert all(piece_a is a for piece_a, _ in cuts)
        assert torch.equal(torch.cat([piece_b for _, piece_b in cuts]), b) and cuts[0][1].shape[0] == width_out // 2
    else:
        assert all(piece_b is b for _, piece_b in cuts)
        assert torch.equal(torch.cat([piece_a for piece_a, _ in cuts], dim=1), a) and cuts[0][0].shape[1] == width_in // 2
        x = torch.randn(3, width_in)
        halves = [x[:, r * width_in // 2:(r + 1) * width_in // 2] @ pa.T @ pb.T for r, (pa, pb) in enumerate(cuts)]
        assert torch.allclose(sum(halves), x @ a.T @ b.T, atol=1e-5)


@pytest.mark.parametrize("part, dim", [("gate", 0), ("up", 0), ("down", 1)])
def test_an_experts_matrices_are_cut_inside(part, dim):
    whole = torch.randn(12, 12)
    parts = [Shard(rank, 3).expert_piece(part, whole) for rank in range(3)]
    assert all(p.is_contiguous() and p.shape[dim] == 4 for p in parts)
    assert torch.equal(torch.cat(parts, dim=dim), whole)


class OneRankOfMany:
    """One rank's view of the collectives, every rank's partials kept: the sum over ranks and the
    ranks' logits side by side are taken once every rank has given its part."""

    def __init__(self, rank: int, partials: list, logits: list) -> None:
        self.rank, self.partials, self.logits = rank, partials, logits

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.partials.append(x)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x if rank == self.rank else logits for rank, logits in enumerate(self.logits)], dim=-1)


def test_the_vocabulary_slices_embed_and_give_logits_as_the_whole_tables():
    from pagedserve.worker.runner.models.vocab_parallel import VocabSlice

    vocab, size = 101, 4
    table, head = torch.randn(vocab, 8), torch.randn(vocab, 8)
    ids, hidden = torch.tensor([0, 25, 26, 51, 77, 100]), torch.randn(6, 8)
    rows = Shard(0, size).vocab_rows(vocab)
    partials: list = []
    logits = [hidden @ Shard(r, size).piece("lm_head.weight", lambda: head, CONFIG).T for r in range(size)]
    for rank in range(size):
        piece = Shard(rank, size).piece("model.embed_tokens.weight", lambda: table, CONFIG)
        group = OneRankOfMany(rank, partials, logits)
        VocabSlice(group, rows, vocab).embed(torch.nn.Embedding.from_pretrained(piece), ids)
    assert all(p.shape == (6, 8) for p in partials) and torch.equal(sum(partials), table[ids])
    assert [int(p.any(dim=1).sum()) for p in partials] == [2, 2, 1, 1]  # each id on its rank alone
    gathered = VocabSlice(OneRankOfMany(2, [], logits), rows, vocab).gather(logits[2])
    assert gathered.shape == (6, vocab) and torch.allclose(gathered, hidden @ head.T, atol=1e-5)
