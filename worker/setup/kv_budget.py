"""The KV budget against the context: how many tokens the pool holds, how many full-length sequences
fit, and what happens when not even one does (as vLLM: refuse to start with the numbers, or cap a
``max_model_len`` the user did not set to what fits, saying so)."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import structlog

from pagedserve.worker.core.kv_cache.kv_layout import blocks_held


class ContextDoesNotFit(ValueError):
    """``--max-model-len`` was asked for, and one sequence of it needs more KV than the budget holds."""


@dataclass(frozen=True)
class KvBudget:
    blocks: int
    block_size: int
    bytes_per_token: int  # of one lane (a block's bytes / block_size)
    lane_windows: tuple[int, ...] = (0,)  # worker/core/kv_cache/kv_layout.py
    chunk: int = 0  # tokens a step computes at most: a sliding lane holds its window and one chunk

    @property
    def tokens(self) -> int:
        """The tokens the budget holds: one sequence's longest where a lane keeps every position, else
        (every lane slides) the pool's slots."""
        return self.longest() if 0 in self.lane_windows else self.blocks * self.block_size

    @property
    def pool_bytes(self) -> int:
        return self.blocks * self.block_size * self.bytes_per_token

    def blocks_for(self, length: int) -> int:
        """Blocks one sequence of ``length`` tokens holds at most, every lane counted."""
        return blocks_held(self.lane_windows, length, self.block_size, self.chunk)

    def longest(self) -> int:
        """The longest sequence the budget holds alone (whole blocks)."""
        full = sum(1 for w in self.lane_windows if not w)
        if not full:  # a sequence holds its lanes' windows at any length
            return sys.maxsize if self.blocks_for(sys.maxsize // 2) <= self.blocks else 0
        length = (self.blocks // full) * self.block_size  # an upper bound: the sliding lanes take their share
        while length > 0 and self.blocks_for(length) > self.blocks:
            length -= self.block_size
        return max(0, length)

    def fit_context(self, max_len: int, asked: bool) -> int:
        """``max_len``, or what fits when it does not and was not ``asked``; a ``ContextDoesNotFit``
        when it was. A sliding lane holds its window's blocks at any length."""
        if self.blocks_for(max_len) <= self.blocks:
            return max_len
        if asked:
            need, longest = self.blocks_for(max_len), self.longest()
            raise ContextDoesNotFit(
                f"max_model_len {max_len} needs {need} KV blocks ({_gib(need * self.block_size * self.bytes_per_token)}) "
                f"for one sequence, but the KV budget holds {self.blocks} blocks ({self.tokens} tokens, "
                f"{_gib(self.pool_bytes)}): raise --kv-cache-memory (or --num-gpu-blocks), "
                f"or lower --max-model-len to at most {longest}")
        return self.longest()

    def context(self, max_len: int, asked: bool) -> int:
        """``fit_context``, said in the log: the cap where there is one, then the budget."""
        log = structlog.get_logger("pagedserve.engine")
        fitted = self.fit_context(max_len, asked)
        if fitted < max_len:
            log.warning("max_model_len capped to what the KV budget holds (set --max-model-len, or raise "
                        "--kv-cache-memory to serve the model's whole context)", model_context=max_len,
                        max_model_len=fitted, kv_blocks=self.blocks)
        log.info("kv budget", tokens=self.tokens, max_model_len=fitted, full_length_sequences=self.full_sequences(fitted),
                 **({"lane_windows": list(self.lane_windows)} if len(self.lane_windows) > 1 else {}))
        return fitted

    def full_sequences(self, max_len: int) -> int:
        """How many sequences of ``max_len`` tokens the budget holds at once."""
        return self.blocks // max(1, self.blocks_for(max(1, max_len)))


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
