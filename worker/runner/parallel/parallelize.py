"""A loaded rank's model wired to its ranks: every attention and feed-forward block sums its
partial output over the ranks (one all-reduce each), the embedding and the head go through the
vocabulary slices (``worker/runner/models/vocab_parallel.py``)."""

from __future__ import annotations

from pagedserve.worker.runner.models.layers import CausalLM
from pagedserve.worker.runner.models.vocab_parallel import VocabSlice
from pagedserve.worker.runner.parallel.group import RankGroup
from pagedserve.worker.runner.parallel.shard import Shard


def parallelize(model: CausalLM, group: RankGroup, vocab_size: int) -> CausalLM:
    for layer in model.model.layers:
        layer.self_attn.reduce = group.all_reduce
        layer.mlp.reduce = group.all_reduce  # a dense MLP or a whole MoE block (its shared expert inside adds no sum)
    model.vocab = VocabSlice(group, Shard(group.rank, group.size).vocab_rows(vocab_size), vocab_size)
    return model
