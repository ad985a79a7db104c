"""A program written for vLLM's ``LLM`` (``written_for_vllm.py``: generate with ``n``, a seed, top-p
and logprobs; prompt logprobs; a stop string; chat) runs on the real default model with its import
swapped for pagedserve's and nothing else changed, and what it reads holds together: each position's
dict has its token with its vocabulary rank and the top alternatives ranked 1..k, texts that spell
the completion, cumulative logprobs that sum the tokens', the stop string named, the templated chat
prompt."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

PROGRAM = Path(__file__).with_name("written_for_vllm.py")
VLLM_IMPORT = "from vllm import LLM, SamplingParams"


def run_swapped(tmp_path: Path, model: Path, capsys, monkeypatch) -> dict:
    source = PROGRAM.read_text()
    assert source.count(VLLM_IMPORT) == 1 and "import vllm" not in source
    swapped = tmp_path / "program.py"
    swapped.write_text(source.replace(VLLM_IMPORT, "from pagedserve import LLM, SamplingParams"))
    monkeypatch.setattr(sys, "argv", [str(swapped), str(model)])
    runpy.run_path(str(swapped), run_name="__main__")
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_program_written_for_vllm_runs_unchanged_after_swapping_its_import(real_model, tmp_path, capsys, monkeypatch):
    report = run_swapped(tmp_path, real_model.gguf, capsys, monkeypatch)
    completions = report["generate"]
    assert [(c["prompt"], c["prompt_tokens"], c["index"]) for c in completions] == [
        ("Hello, my name is", 5, 0), ("Hello, my name is", 5, 1),
        ("The capital of France is", 5, 0), ("The capital of France is", 5, 1)]
    for c in completions:
        assert c["finish_reason"] == "length" and c["tokens"] == len(c["positions"]) == 12
        assert c["cumulative_logprob"] == pytest.approx(sum(p["logprob"] for p in c["positions"]), abs=1e-3)
        assert "".join(p["text"] for p in c["positions"]) == c["text"]
        for p in c["positions"]:  # its token first with its rank, then the three best ranked 1..3
            assert p["ranks"][0] == p["rank"] >= 1 and (p["rank"] == 1) == (p["logprob"] == p["best"])
            assert sorted(p["ranks"][1:] + [p["rank"]] * (p["rank"] <= 3)) == [1, 2, 3]
    assert any(p["rank"] > 3 for c in completions for p in c["positions"])  # sampled at 0.8: not always a top one
    first, *scored = report["prompt_logprobs"]
    assert first is None and len(scored) == 7
    assert all(e["rank"] >= 1 and e["entries"] == (2 if e["rank"] <= 2 else 3) for e in scored)
    tokens = report["tokens_prompt"]  # vLLM's TokensPrompt; the stop case below is its TextPrompt
    assert tokens["prompt_token_ids"] == tokens["ids"] and tokens["prompt"] is None
    assert report["stop"]["finish_reason"] == "stop" and report["stop"]["stop_reason"] == " six"
    assert " six" not in report["stop"]["text"] and report["stop"]["text"].strip()
    chat = report["chat"]
    assert chat["prompt"].startswith("<|im_start|>") and "Say hello.<|im_end|>" in chat["prompt"]
    assert chat["prompt"].endswith("<|im_start|>assistant\n") and chat["text"]
