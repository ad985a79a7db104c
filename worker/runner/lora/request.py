"""``LoRARequest``: an adapter for offline generation, as vLLM's offline API names one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # vLLM's id; kept for its signature, the name is what identifies an adapter here
    lora_path: str  # a PEFT adapter directory, read the first time the name is seen
