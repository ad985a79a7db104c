"""Offline generation: ``LLM(model).generate(prompts, params)``, no Redis, no server.

    from pagedserve.worker import LLM, SamplingParams
    llm = LLM()  # the default model; or LLM("path/to/model", ...), LLM("model.gguf"), LLM("demo")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)

The outputs are vLLM's shapes (``offline_outputs.py``): a program written for vLLM's ``LLM`` runs
after swapping its import (``tests/engine/test_vllm_program.py``).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Sequence as Seq

from tqdm.auto import tqdm

from pagedserve.shared.prompts import render_chat
from pagedserve.shared.sampling import SamplingParams
from pagedserve.worker.core.scheduling.outputs import RequestOutput
from pagedserve.worker.core.scheduling.token_pieces import TokenPieces
from pagedserve.worker.engine import Engine
from pagedserve.worker.offline_outputs import offline_output
from pagedserve.worker.runner.lora.request import LoRARequest
from pagedserve.worker.setup.engine_config import EngineConfig
from pagedserve.worker.source.resolve import model_or_default

Prompt = str | Seq[int]


def vllm_prompt(prompt) -> Prompt:
    """A prompt as vLLM's ``LLM.generate`` takes it: text, token ids, a ``TextPrompt`` (``{"prompt":
    text}``) or a ``TokensPrompt`` (``{"prompt_token_ids": ids}``)."""
    if not isinstance(prompt, dict):
        return prompt
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if "prompt" in prompt:
        return prompt["prompt"]
    raise ValueError('a prompt given as a dict needs "prompt" (text) or "prompt_token_ids" (token ids)')


class LLM:
    def __init__(self, model: str | Path | None = None, **kwargs) -> None:
        """``model``: a model directory, a ``.gguf`` file, a hub id, ``"demo"``, or None (the
        default model, SmolLM2-135M-Instruct; ``worker/source/resolve.py``)."""
        self.engine = Engine(EngineConfig(model=model_or_default(model), **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()
        self._pieces = TokenPieces(self.tokenizer)

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's ``{"prompt": text}`` and
        ``{"prompt_token_ids": ids}``); outputs come back in input order, in vLLM's
        shapes (``worker/offline_outputs.py``). ``lora_request``: the LoRA adapter every prompt runs
        under, or one per prompt (None: the base model); an adapter not loaded yet is read from its
        path (the engine needs ``enable_lora=True``)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [vllm_prompt(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._generate(list(prompts), texts, sampling_params, use_tqdm, lora_request)

    def embed(self, prompts: Prompt | Seq[Prompt], pooling: str = "last", *, use_tqdm: bool = True) -> list[list[float]]:
        """Each prompt's embedding: its final hidden states pooled (``"last"`` token, or ``"mean"``)
        and normalised, through the same batching as generation (prefill only)."""
        outputs = self.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling), use_tqdm=use_tqdm)
        return [out.embedding for out in outputs]

    def get_tokenizer(self):
        """The model's tokenizer (transformers'), as vLLM's ``LLM.get_tokenizer``."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's generation-config defaults (temperature, top_p,
        top_k, min_p, repetition_penalty) unless the engine was built with ``generation_config="vllm"``."""
        return SamplingParams(**self.engine.sampling_defaults)

    def chat(
        self,
        messages: list[dict] | Seq[list[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation or a list of them, then generate
        (each output's ``prompt``: the templated text)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [render_chat(self.tokenizer, c) for c in conversations]
        prompts = [self.tokenizer.encode(text, add_special_tokens=False) for text in texts]
        return self._generate(prompts, texts, sampling_params, use_tqdm, lora_request)

    def _generate(self, prompts: list[Prompt], texts: list[str | None], params, use_tqdm: bool,
                  lora_request) -> list[RequestOutput]:
        params_list = _broadcast(params or self.get_default_sampling_params(), len(prompts))
        adapters = self._adapters(lora_request, len(prompts))
        ids: list[str] = []
        try:
            for prompt, p, adapter in zip(prompts, params_list, adapters):
                ids.append(f"offline-{next(self._ids)}")
                self.engine.add_request(ids[-1], prompt, p, adapter=adapter)
        except Exception:
            for request_id in ids:  # one bad prompt: nothing of this call stays queued
                self.engine.abort(request_id)
            self.engine.step()
            raise
        return [offline_output(out, text, self._pieces) for out, text in zip(self._run(ids, use_tqdm), texts)]

    def _adapters(self, lora_request, count: int) -> list[str | None]:
        """Each prompt's adapter name, reading those not loaded yet."""
        requests = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * count
        if len(requests) != count:
            raise ValueError(f"got {len(requests)} LoRA requests for {count} prompts")
        for request in {r for r in requests if r is not None}:
            adapters = self.engine.adapters
            if adapters is None or request.lora_name not in adapters.loaded:
                self.engine.load_adapter(request.lora_name, request.lora_path)
        return [None if r is None else r.lora_name for r in requests]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        wanted = set(ids)
        with tqdm(total=len(ids), desc="generating", unit="req", disable=None if use_tqdm else True) as bar:
            while wanted - done.keys():
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]


def _broadcast(params: SamplingParams | Seq[SamplingParams], count: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params
