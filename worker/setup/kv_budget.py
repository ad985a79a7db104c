"""The KV budget against the context: how many tokens the pool holds, how many full-length sequences
fit, and what happens when not even one does (as vLLM: refuse to start with the numbers, or cap a
``max_model_len`` the user did not set to what fits, saying so)."""

from __future__ import annotations

from dataclasses import dataclass

import structlog


class ContextDoesNotFit(ValueError):
    """``--max-model-len`` was asked for, and one sequence of it needs more KV than the budget holds."""


@dataclass(frozen=True)
class KvBudget:
    blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    def fit_context(self, max_len: int, asked: bool, window: int = 0) -> int:
        """``max_len``, or what fits when it does not and was not ``asked``; a ``ContextDoesNotFit``
        when it was. ``window``: every layer slides within it, so a sequence holds a window's blocks
        at any length and nothing needs capping."""
        if window or max_len <= self.tokens:
            return max_len
        if asked:
            need = -(-max_len // self.block_size)
            raise ContextDoesNotFit(
                f"max_model_len {max_len} needs {need} KV blocks ({_gib(need * self.block_size * self.bytes_per_token)}) "
                f"for one sequence, but the KV budget holds {self.blocks} blocks ({self.tokens} tokens, "
                f"{_gib(self.tokens * self.bytes_per_token)}): raise --kv-cache-memory (or --num-gpu-blocks), "
                f"or lower --max-model-len to at most {self.tokens}")
        return self.tokens

    def context(self, max_len: int, asked: bool, window: int = 0) -> int:
        """``fit_context``, said in the log: the cap where there is one, then the budget."""
        log = structlog.get_logger("pagedserve.engine")
        fitted = self.fit_context(max_len, asked, window)
        if fitted < max_len:
            log.warning("max_model_len capped to what the KV budget holds (set --max-model-len, or raise "
                        "--kv-cache-memory to serve the model's whole context)", model_context=max_len,
                        max_model_len=fitted, kv_blocks=self.blocks)
        log.info("kv budget", tokens=self.tokens, max_model_len=fitted, full_length_sequences=self.full_sequences(fitted))
        return fitted

    def full_sequences(self, max_len: int) -> int:
        """How many sequences of ``max_len`` tokens the budget holds at once."""
        return self.tokens // max(1, max_len)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
