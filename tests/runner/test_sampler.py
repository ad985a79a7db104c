"""Sampling: filters never leak tokens, seeds reproduce across batches, logprobs are log_softmax."""

import torch

from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.runner.sampling.sampler import Sampler, SampleRow, filtered_probs

VOCAB = 50


def row(params, output=(), prompt=(1, 2, 3), index=0, n=1):
    return SampleRow(params, tuple(prompt), tuple(output), index, n, len(output))


def logits_batch(rows, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_logprobs_match_log_softmax():
    logits = logits_batch(4)
    params = SamplingParams(temperature=0.0, logprobs=5)
    out = Sampler(frozenset()).sample(logits, [row(params)] * 4)
    ref = torch.log_softmax(logits, dim=-1)
    for i, (tok,) in enumerate(out):
        assert tok.token_id == int(logits[i].argmax())
        assert abs(tok.logprob - float(ref[i, tok.token_id])) < 1e-6
        top = ref[i].topk(5)
        assert set(tok.top_logprobs) == set(top.indices.tolist())
        for t, lp in tok.top_logprobs.items():
            assert abs(lp - float(ref[i, t])) < 1e-6


def test_filters_never_emit_tokens_outside_their_set():
    logits = logits_batch(1, seed=1)[0]
    probs = torch.softmax(logits, dim=-1)
    order = probs.argsort(descending=True)
    sampler = Sampler(frozenset(), seed=3)
    cases = {
        "top_k": (SamplingParams(top_k=5), set(order[:5].tolist())),
        "top_p": (SamplingParams(top_p=0.5), set(order[: int((probs[order].cumsum(0) < 0.5).sum()) + 1].tolist())),
        "min_p": (SamplingParams(min_p=0.2), set((probs >= 0.2 * probs.max()).nonzero()[:, 0].tolist())),
    }
    for name, (params, allowed) in cases.items():
        seen = set()
        for _ in range(20):
            out = sampler.sample(logits[None].repeat(50, 1), [row(params)] * 50)
            seen |= {toks[0].token_id for toks in out}
        assert seen <= allowed, name
        assert len(seen) > 1 or len(allowed) == 1, name


def test_filtered_probs_keep_the_top_token_and_renormalise():
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    probs = filtered_probs(logits, [SamplingParams(top_p=0.01)])
    assert probs[0].nonzero()[:, 0].tolist() == [0]


def test_seeded_sampling_is_reproducible_across_batch_compositions():
    params = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=1.0)
    target = logits_batch(1, seed=9)
    alone = Sampler(frozenset(), seed=0).sample(target, [row(params)])[0][0].token_id
    picks = set()
    for seed in range(5):
        noise = logits_batch(6, seed=seed + 10)
        batch = torch.cat([noise[:3], target, noise[3:]])
        rows = [row(other)] * 3 + [row(params)] + [row(other)] * 3
        picks.add(Sampler(frozenset(), seed=seed).sample(batch, rows)[3][0].token_id)
    assert picks == {alone}


def test_seeded_draws_differ_by_position_and_fork_index():
    params = SamplingParams(temperature=5.0, seed=7)
    logits = torch.zeros(1, VOCAB)
    sampler = Sampler(frozenset())
    by_position = {sampler.sample(logits, [row(params, output=[1] * k)])[0][0].token_id for k in range(20)}
    forks = sampler.sample(logits, [row(params, n=8)])[0]
    assert len(by_position) > 5
    assert len({t.token_id for t in forks}) > 3


def test_penalties_and_min_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 7] = 2.0
    logits[0, 8] = 1.9
    sampler = Sampler(frozenset({7}))
    assert sampler.sample(logits, [row(SamplingParams(temperature=0.0, min_tokens=2))])[0][0].token_id == 8
    assert sampler.sample(logits, [row(SamplingParams(temperature=0.0, min_tokens=2), output=[3, 4])])[0][0].token_id == 7
    rep = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sampler.sample(logits, [row(rep, prompt=[7])])[0][0].token_id == 8
    freq = SamplingParams(temperature=0.0, frequency_penalty=0.05)
    assert sampler.sample(logits, [row(freq, output=[7, 7, 7])])[0][0].token_id == 8
    presence = SamplingParams(temperature=0.0, presence_penalty=0.2)
    assert sampler.sample(logits, [row(presence, output=[7])])[0][0].token_id == 8
    assert sampler.sample(logits, [row(presence, prompt=[7])])[0][0].token_id == 7  # prompt does not count


def test_sampling_distribution_follows_probabilities():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    sampler = Sampler(frozenset(), seed=0)
    out = sampler.sample(logits.repeat(4000, 1), [row(SamplingParams(temperature=1.0))] * 4000)
    counts = torch.bincount(torch.tensor([t[0].token_id for t in out]), minlength=3).float() / 4000
    assert torch.allclose(counts, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_ranks_under_ties_are_vllms_and_an_entry_never_holds_one_rank_twice():
    """bfloat16 logits tie often. A token's rank counts every token at least as likely, itself
    included (vLLM's ``batched_count_greater_than`` is ``>=``); one among the top ``k`` takes its place
    there, as vLLM's entry overwrites it: one position's entry ranks its tokens 1..k (+ its own)."""
    from pagedserve.worker.offline_outputs import logprob_entry
    from pagedserve.worker.runner.sampling.drawn_tokens import scored_token
    from pagedserve.worker.runner.sampling.sampler import vocab_ranks

    row = torch.tensor([[-1.0, -2.0, -2.0, -3.0, -2.0]])
    assert vocab_ranks(row, torch.tensor([-1.0])).tolist() == [1]
    assert vocab_ranks(row, torch.tensor([-2.0])).tolist() == [4]  # three tied at -2: counted against it
    top = ([0, 1, 2], [-1.0, -2.0, -2.0])  # torch.topk's order among the ties
    for token, rank in ((2, 4), (1, 4), (4, 4), (3, 5)):
        entry = logprob_entry(scored_token(token, row[0, token].item(), top, True, rank), str)
        ranks = sorted(logprob.rank for logprob in entry.values())
        assert ranks == ([1, 2, 3] if token in top[0] else [1, 2, 3, rank]), (token, entry)
    assert logprob_entry(scored_token(2, -2.0, top, True, 4), str)[2].rank == 3  # its place in the top
