"""The cost model of a simulated worker's step (``--simulate``, ``worker/runner/simulated.py``):
``base + per_seq * sequences + per_token * tokens`` seconds, written ``BASE,PER_SEQ,PER_TOKEN``.
Here, so the flag is checked where flags are read and the worker parses it the same way."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SimulatedCost:
    base_s: float
    per_seq_s: float
    per_token_s: float

    @classmethod
    def parse(cls, text: str) -> "SimulatedCost":
        """``"BASE,PER_SEQ,PER_TOKEN"`` in seconds."""
        try:
            base, per_seq, per_token = (float(part) for part in text.split(","))
        except ValueError:
            raise ValueError(f"a step cost is BASE,PER_SEQ,PER_TOKEN in seconds, got {text!r}") from None
        if min(base, per_seq, per_token) < 0:
            raise ValueError(f"step cost terms must be >= 0, got {text!r}")
        return cls(base, per_seq, per_token)

    def seconds(self, seqs: int, tokens: int) -> float:
        return self.base_s + self.per_seq_s * seqs + self.per_token_s * tokens
