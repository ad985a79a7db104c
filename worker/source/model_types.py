"""The model families served, by ``config.model_type``, each with the transformers class its
checkpoints name (``architectures``). Read where a model comes from (a GGUF read as a model
directory names its class) and by the runner, which builds each family
(``worker/runner/models/families.py``) and refuses a checkpoint that names another class."""

from __future__ import annotations

CAUSAL_LM = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def supported() -> str:
    return ", ".join(f"{model_type} ({name})" for model_type, name in CAUSAL_LM.items())
