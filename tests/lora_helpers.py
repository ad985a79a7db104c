"""Random PEFT LoRA adapters of the zoo's models, and transformers' greedy output with one merged:
the multi-LoRA tests' reference."""

from __future__ import annotations

import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(zoo, model: str, path, rank: int, targets: list[str], seed: int, **extra):
    """A random PEFT adapter of ``model`` saved at ``path``; transformers' model with it merged."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(zoo.path(model), dtype=torch.float32)
    # init_lora_weights=False: B random too, so the adapter changes the output from the start
    peft_model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, lora_dropout=0.0,
                                                 init_lora_weights=False, **extra))
    peft_model.save_pretrained(path)
    return peft_model.merge_and_unload().eval()


def greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers ``generate``, greedy, one prompt."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=model.config.pad_token_id)
    return out[0, len(prompt):].tolist()
