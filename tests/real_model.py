"""The real default model for the tests: SmolLM2-135M-Instruct's GGUF, with transformers reading
the same file (its own GGUF reader and dequantizer) as the reference: greedy continuations and
log-softmax, float32, one prompt at a time (no padding)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

# twelve chat prompts: facts, arithmetic, code, lists, and text outside ASCII
CHAT_PROMPTS = [
    "What is the capital of France?",
    "What is 2+2?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "Write a Python function that adds two numbers.",
    "Who wrote Romeo and Juliet?",
    "Explain photosynthesis in one sentence.",
    "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into Spanish.",
    "List the days of the week.",
    "안녕하세요! 자기소개 해주세요.",
    "用中文介绍一下北京。",
]


class RealModel:
    def __init__(self, gguf: Path) -> None:
        self.gguf = gguf
        self._greedy: dict[tuple, list[int]] = {}
        self._logprobs: dict[tuple, list[float]] = {}  # a reference forward is seconds on the 1.5B: once a text

    @cached_property
    def model_dir(self) -> Path:
        from pagedserve.worker.source.resolve import resolve_model_dir

        return resolve_model_dir(self.gguf)

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    @cached_property
    def hf(self):
        import torch
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(self.gguf.parent, gguf_file=self.gguf.name,
                                                    dtype=torch.float32).eval()

    def chat_ids(self, content: str) -> list[int]:
        return list(self.tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                                       tokenize=True, return_dict=True)["input_ids"])

    def hf_greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """transformers ``generate``, greedy, stopping at the model's end of turn as the engine does."""
        key = (tuple(prompt), max_new_tokens)
        if key not in self._greedy:
            import torch

            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                       do_sample=False, eos_token_id=self.hf.config.eos_token_id,
                                       pad_token_id=self.hf.config.pad_token_id)
            tokens = out[0, len(prompt):].tolist()
            self._greedy[key] = tokens
        return self._greedy[key]

    def hf_logprobs(self, prompt: list[int], continuation: list[int]) -> list[float]:
        """log-softmax of transformers' logits at each continuation token."""
        key = (tuple(prompt), tuple(continuation))
        if key not in self._logprobs:
            import torch

            ids = torch.tensor([prompt + continuation])
            with torch.inference_mode():
                logits = self.hf(ids).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            self._logprobs[key] = [logprobs[len(prompt) + i - 1, token].item() for i, token in enumerate(continuation)]
        return list(self._logprobs[key])
