"""Settings for the services: flags, then environment (``PAGEDSERVE_*``, ``REDIS_URL``), then defaults.

This is the one place the environment is read. Each service builds its frozen settings here once.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping


def env_default(environ: Mapping[str, str], name: str, default, kind=str):
    """``PAGEDSERVE_<NAME>`` (or ``REDIS_URL`` for redis_url) converted to ``kind``, else ``default``."""
    key = "REDIS_URL" if name == "redis_url" else f"PAGEDSERVE_{name.upper()}"
    raw = environ.get(key)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except ValueError:
        raise SystemExit(f"pagedserve: {key}={raw!r} is not a valid {kind.__name__}") from None


def redis_url_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    return env_default(os.environ if environ is None else environ, "redis_url", None)


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where built models live: ``PAGEDSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedserve``, else ``~/.cache/pagedserve``."""
    environ = os.environ if environ is None else environ
    if environ.get("PAGEDSERVE_CACHE_DIR"):
        return Path(environ["PAGEDSERVE_CACHE_DIR"])
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedserve"


@dataclass(frozen=True)
class WorkerSettings:
    model: str
    redis_url: str
    served_model_name: str
    consumer: str
    max_inflight: int
    claim_idle_ms: int
    heartbeat_s: float
    max_deliveries: int
    drain_timeout_s: float
    key_prefix: str
    metrics_port: int = 0  # 0: no Prometheus endpoint
    engine: dict = field(default_factory=dict)  # EngineConfig keyword arguments


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def add_engine_args(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    e = lambda name, default, kind=str: env_default(environ, name, default, kind)  # noqa: E731
    parser.add_argument("--dtype", default=e("dtype", "auto"))
    parser.add_argument("--block-size", type=_positive(int), default=e("block_size", 16, int))
    parser.add_argument("--kv-cache-memory", type=_positive(int), default=e("kv_cache_memory", None, int), help="bytes")
    parser.add_argument("--num-gpu-blocks", type=_positive(int), default=e("num_gpu_blocks", None, int))
    parser.add_argument("--max-num-seqs", type=_positive(int), default=e("max_num_seqs", 256, int))
    parser.add_argument("--max-num-batched-tokens", type=_positive(int), default=e("max_num_batched_tokens", 2048, int))
    parser.add_argument("--max-model-len", type=_positive(int), default=e("max_model_len", None, int))
    parser.add_argument("--preemption-mode", choices=["recompute", "swap"], default=e("preemption_mode", "recompute"))


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        "dtype": args.dtype, "block_size": args.block_size, "kv_cache_memory": args.kv_cache_memory,
        "num_gpu_blocks": args.num_gpu_blocks, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
        "preemption_mode": args.preemption_mode,
    }


def worker_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    environ = os.environ if environ is None else environ
    e = lambda name, default, kind=str: env_default(environ, name, default, kind)  # noqa: E731
    p = argparse.ArgumentParser(prog="pagedserve worker", description="Serve one model from a Redis request stream.")
    p.add_argument("--model", default=e("model", None), help="local directory or hub id (default: the demo model)")
    p.add_argument("--redis-url", default=e("redis_url", "redis://127.0.0.1:6379/0"))
    p.add_argument("--served-model-name", default=e("served_model_name", None), help="stream name (default: --model)")
    p.add_argument("--consumer", default=e("consumer", f"{socket.gethostname()}-{os.getpid()}"), help="stable consumer name")
    p.add_argument("--max-inflight", type=_positive(int), default=e("max_inflight", None, int),
                   help="requests held at once (default: --max-num-seqs)")
    p.add_argument("--claim-idle-ms", type=_positive(int), default=e("claim_idle_ms", 30_000, int),
                   help="reclaim another worker's entries idle this long")
    p.add_argument("--heartbeat", type=_positive(float), default=e("heartbeat", 5.0, float), help="seconds")
    p.add_argument("--max-deliveries", type=_positive(int), default=e("max_deliveries", 3, int))
    p.add_argument("--drain-timeout", type=_positive(float), default=e("drain_timeout", 30.0, float), help="seconds")
    p.add_argument("--key-prefix", default=e("key_prefix", "pagedserve"))
    p.add_argument("--metrics-port", type=int, default=e("metrics_port", 0, int), help="Prometheus port (0: off)")
    add_engine_args(p, environ)
    return p


def worker_settings(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> WorkerSettings:
    args = worker_parser(environ).parse_args(argv)
    if args.heartbeat * 1000 >= args.claim_idle_ms:
        raise SystemExit("pagedserve: --heartbeat must be shorter than --claim-idle-ms, or live work gets reclaimed")
    model = args.model
    if model is None:
        from worker.demo_model import demo_model_dir

        model = str(demo_model_dir())
    return WorkerSettings(
        model=model, redis_url=args.redis_url, served_model_name=args.served_model_name or args.model or "demo",
        consumer=args.consumer, max_inflight=args.max_inflight or args.max_num_seqs,
        claim_idle_ms=args.claim_idle_ms, heartbeat_s=args.heartbeat, max_deliveries=args.max_deliveries,
        drain_timeout_s=args.drain_timeout, key_prefix=args.key_prefix, metrics_port=args.metrics_port,
        engine=engine_kwargs(args),
    )
