"""Beam search and best_of on copy-on-write forks, against transformers ``generate(num_beams=k)``."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM
from pagedserve.shared.errors import InvalidRequestError
from pagedserve.shared.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.engine.test_parity import run_checked


@pytest.fixture(scope="module")
def hf(zoo):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(zoo.path("llama-gqa"), dtype=torch.float32).eval()


def hf_beams(hf, prompt, k, max_new, length_penalty=1.0, early_stopping=False):
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=k, num_return_sequences=k, do_sample=False,
                          max_new_tokens=max_new, length_penalty=length_penalty, early_stopping=early_stopping,
                          output_scores=True, return_dict_in_generate=True, pad_token_id=hf.config.pad_token_id)
    pad, eos = hf.config.pad_token_id, hf.config.eos_token_id
    seqs = []
    for row in out.sequences[:, len(prompt):].tolist():
        if eos in row:  # a beam that finished: transformers fills its row out past the end of turn
            row = row[: row.index(eos) + 1]
        while row and row[-1] == pad:
            row.pop()
        seqs.append(row)
    return seqs, [float(s) for s in out.sequences_scores]


@pytest.mark.parametrize("k", [2, 4, 6])
def test_beam_search_equals_transformers_for_several_prompts_at_once(zoo, hf, k):
    cases = random_prompts(seed=20 + k, count=5, max_len=80, vocab=512, max_new=24)
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=512, block_size=7)
    params = [SamplingParams(use_beam_search=True, beam_width=k, n=k, max_tokens=n) for _, n in cases]
    done = run_checked(llm, [p for p, _ in cases], params)  # invariants every step, nothing leaked
    for i, (prompt, n) in enumerate(cases):
        seqs, scores = hf_beams(hf, prompt, k, n)
        assert [o.token_ids for o in done[i].outputs] == seqs, f"prompt {i}"
        assert [o.cumulative_logprob for o in done[i].outputs] == pytest.approx(scores, abs=1e-4)


@pytest.mark.parametrize("length_penalty,early_stopping", [(0.0, True), (2.0, "never"), (-1.0, False)])
def test_length_penalty_and_early_stopping_like_transformers(zoo, hf, length_penalty, early_stopping):
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=256)
    prompt = [33, 44, 55, 66, 77]
    params = SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=20, length_penalty=length_penalty,
                            early_stopping=early_stopping)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    seqs, scores = hf_beams(hf, prompt, 3, 20, length_penalty, early_stopping)
    assert [o.token_ids for o in out.outputs] == seqs[:2]
    assert [o.cumulative_logprob for o in out.outputs] == pytest.approx(scores[:2], abs=1e-4)


def test_beams_share_blocks_and_abort_frees_everything(zoo):
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=256, block_size=4)
    engine = llm.engine
    engine.add_request("beam", list(range(20, 60)), SamplingParams(use_beam_search=True, beam_width=4, max_tokens=50,
                                                                   ignore_eos=True))
    shared_seen, kept = False, []
    for _ in range(12):
        engine.step()
        usage = engine.scheduler.blocks.usage()
        shared_seen |= usage.logical > usage.used
        engine.scheduler.blocks.check_invariants()
        kept.append(len(engine.runner.tables))
    assert shared_seen, "beams should share their prompt blocks"
    assert max(kept) <= 2 * 4, kept  # the runner keeps tables of live beams (and of the last step's dropped ones) only
    assert engine.abort("beam")
    outs = engine.step()
    assert outs and outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert engine.scheduler.blocks.usage().used == 0


def test_best_of_returns_the_most_likely_samples(zoo):
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=256)
    out = llm.generate([[5, 6, 7]], SamplingParams(n=2, best_of=6, temperature=1.0, seed=4, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    every = llm.generate([[5, 6, 7]], SamplingParams(n=6, temperature=1.0, seed=4, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)[0]
    best = sorted(every.outputs, key=lambda o: -o.cumulative_logprob)[:2]
    assert [o.token_ids for o in out.outputs] == [o.token_ids for o in best]
    assert [o.index for o in out.outputs] == [0, 1]


def test_beam_parameters_are_validated():
    with pytest.raises(InvalidRequestError, match="beam_width"):
        SamplingParams(use_beam_search=True, beam_width=2, n=3)
    with pytest.raises(InvalidRequestError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(InvalidRequestError, match="early_stopping"):
        SamplingParams(use_beam_search=True, beam_width=2, early_stopping="sometimes")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_beam_search_survives_preemption(zoo, hf, mode):
    cases = random_prompts(seed=40, count=8, max_len=60, vocab=512, max_new=20)
    llm = LLM(zoo.path("llama-gqa"), device="cpu", dtype="float32", num_gpu_blocks=48, num_cpu_blocks=200, block_size=7,
              preemption_mode=mode, max_num_batched_tokens=64)
    params = [SamplingParams(use_beam_search=True, beam_width=4, n=2, max_tokens=n) for _, n in cases]
    done = run_checked(llm, [p for p, _ in cases], params)
    assert llm.engine.scheduler.stats.num_preemptions > 0
    for i, (prompt, n) in enumerate(cases):
        seqs, scores = hf_beams(hf, prompt, 4, n)
        assert [o.token_ids for o in done[i].outputs] == seqs[:2], f"prompt {i}"
