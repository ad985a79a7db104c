"""Small random-weight models built locally, saved like any Hugging Face checkpoint.

Used by the tests (one per supported family) and by ``pagedserve up`` when no model is named.
Deterministic: the same arguments give the same files. The tokenizer is a byte-level BPE trained
with the ``tokenizers`` library on a text shipped with the package, with a chat template.
Their output is noise: they exist to exercise the serving path, not to say anything.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

CHAT_TEMPLATE = (  # Hermes-style tools: listed in a system turn, called as <tool_call>{"name", "arguments"}</tool_call>
    "{% if tools %}<|system|>\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|end|>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ {'name': c['function']['name'], "
    "'arguments': c['function']['arguments']} | tojson }}</tool_call>{% endfor %}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)  # enable_thinking (chat_template_kwargs): false writes an empty think block, as Qwen3's template does
SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    # Gemma 2: alternating sliding (8 tokens) and global layers, soft caps that bite on random weights
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8,
                                                    "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    # Gemma 3 (text): 5 local layers (window 8, base 10,000) to 1 global (base 1,000,000)
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.5, "sliding_window": None}),  # as Phi-4-mini: half the head rotates
    # mixture of experts: 4 experts of which 2 per token; Qwen2-MoE with its shared expert, Qwen3-MoE
    # with one dense layer among the sparse ones
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                        "sliding_window": None}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 96,
        "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 0.5}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [1]}),
}


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = resources.files("pagedserve.worker.source.demo").joinpath("corpus.txt").read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(
    path: str | Path,
    family: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.02,
    rope_scaling: dict | None = None,
    seed: int = 0,
    padded_vocab_size: int | None = None,
    device: str = "cpu",
    dtype: str | None = None,
    **config_overrides,
) -> Path:
    """Write a random-weight model of ``family`` with its tokenizer to ``path``; return the path.

    ``padded_vocab_size``: a larger embedding than the tokenizer needs (as many checkpoints pad
    theirs), for benchmarks with realistic vocabularies. ``device``/``dtype``: where the random
    weights are made and how they are saved (a 1B model is made in seconds on a GPU).
    ``config_overrides``: further config fields (e.g. ``sliding_window``) over the family's."""
    import torch
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILIES)}")
    config_name, model_name, extra = FAMILIES[family]
    path = Path(path)
    tokenizer = build_tokenizer(vocab_size)
    config = getattr(transformers, config_name)(
        vocab_size=max(len(tokenizer), padded_vocab_size or 0), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **{**extra, **config_overrides},
    )
    if rope_scaling:
        _set_rope_scaling(config, rope_scaling)
    torch.manual_seed(seed)
    with torch.device(device):
        model = getattr(transformers, model_name)(config).eval()
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _set_rope_scaling(config, scaling: dict) -> None:
    """Set rope scaling on a transformers 5 (``rope_parameters``) or 4 (``rope_scaling``) config."""
    if getattr(config, "rope_parameters", None) is not None:
        config.rope_parameters = {**config.rope_parameters, **scaling}
    else:
        config.rope_scaling = dict(scaling)


DEMO_MODEL = dict(family="llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=688)
DEMO_VERSION = 2  # bumped when the demo model or its tokenizer changes (2: the chat template takes tools)


def demo_model_dir(cache_root: Path | None = None) -> Path:
    """The demo model's directory, built on first use (atomically, so a crash leaves no half model)."""
    import shutil
    import tempfile

    from pagedserve.runtime.env import cache_dir

    root = cache_root or cache_dir()
    path = root / f"demo-llama-v{DEMO_VERSION}"
    if not (path / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".building-"))
        try:
            build_model(tmp, **DEMO_MODEL)
            tmp.rename(path)
        except OSError:
            if not (path / "config.json").exists():
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path
