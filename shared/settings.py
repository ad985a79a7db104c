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

from shared.model_source import served_name
from shared.step_cost import StepCost


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
    """Where built models and compiled CPU kernels live: ``PAGEDSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedserve``, else ``~/.cache/pagedserve``."""
    environ = os.environ if environ is None else environ
    if environ.get("PAGEDSERVE_CACHE_DIR"):
        return Path(environ["PAGEDSERVE_CACHE_DIR"])
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedserve"


@dataclass(frozen=True)
class WorkerSettings:
    model: str | None  # None: the demo model (shared.model_source.model_or_demo)
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
    metrics_host: str = "127.0.0.1"
    read_ahead: int = 16  # requests read but not yet started (no event sent) at most
    log_stats_interval_s: float = 10.0  # a stats log line this often while busy; 0: none
    engine: dict = field(default_factory=dict)  # EngineConfig keyword arguments
    kv_events_interval_s: float = 0.05  # KV events (prefix-cache changes) go out at most this often
    kv_resync_s: float = 30.0  # and all the cache holds, this often (a reader that missed entries catches up)
    dashboard_interval_s: float = 0.25  # a KV dashboard snapshot this often at most, while a dashboard is open


def checked(kind, ok, rule: str):
    """An argparse type: ``kind(text)``, refused with ``must be <rule>`` unless ``ok(value)``."""
    def parse(text: str):
        value = kind(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _positive(kind):
    return checked(kind, lambda v: v > 0, "> 0")


def _non_negative(kind):
    return checked(kind, lambda v: v >= 0, ">= 0")


_fraction = checked(float, lambda v: 0 < v <= 1, "in (0, 1]")


def _is_step_cost(text: str) -> bool:
    try:
        StepCost.parse(text)
    except ValueError:
        return False
    return True


_step_cost = checked(str, _is_step_cost, "three seconds >= 0, BASE,PER_SEQ,PER_TOKEN")


def boolean(text: str) -> bool:
    if text.lower() not in ("1", "true", "yes", "0", "false", "no"):
        raise ValueError(text)
    return text.lower() in ("1", "true", "yes")


ATTENTION_BACKENDS = ("auto", "torch", "native", "triton")  # kernels.ops.BACKENDS (shared cannot import kernels)


def add_engine_args(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> list[argparse.Action]:
    """The engine's flags (shared by ``worker`` and ``serve``); each help line ends with its default
    and its environment variable. Returns the flags' actions."""
    e = lambda name, default, kind=str: env_default(environ, name, default, kind)  # noqa: E731
    actions: list[argparse.Action] = []
    add = lambda *a, **k: actions.append(parser.add_argument(*a, **k))  # noqa: E731
    add("--dtype", default=e("dtype", "auto"), choices=["auto", "float32", "bfloat16", "float16"])
    add("--device", default=e("device", None), help="cpu, cuda or cuda:N (default: cuda when available)")
    add("--block-size", type=_positive(int), default=e("block_size", 16, int))
    add("--kv-cache-memory", type=_positive(int), default=e("kv_cache_memory", None, int), help="bytes")
    add("--num-gpu-blocks", type=_positive(int), default=e("num_gpu_blocks", None, int))
    add("--max-num-seqs", type=_positive(int), default=e("max_num_seqs", 256, int))
    add("--max-num-batched-tokens", type=_positive(int), default=e("max_num_batched_tokens", 2048, int))
    add("--max-model-len", type=_positive(int), default=e("max_model_len", None, int))
    add("--preemption-mode", choices=["recompute", "swap"], default=e("preemption_mode", "recompute"))
    add("--enforce-eager", action="store_true", default=e("enforce_eager", False, boolean),
                        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs")
    add("--gpu-memory-utilization", type=_fraction, default=e("gpu_memory_utilization", 0.9, float),
                        help="share of the GPU's memory for weights, KV cache and a step's activations (0, 1]")
    add("--attention-backend", choices=ATTENTION_BACKENDS, default=e("attention_backend", "auto"),
                        help="auto: Triton kernels on CUDA, the C kernel compiled for this CPU elsewhere (torch if it "
                             "cannot be built); torch: the plain PyTorch reference")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=e("enable_prefix_caching", True, boolean), help="share KV blocks of identical prompt prefixes")
    add("--swap-space", type=_non_negative(float), default=e("swap_space", 1.0, float),
                        help="GiB of CPU memory for KV blocks of preempted requests (with --preemption-mode swap)")
    add("--simulate", type=_step_cost, default=e("simulate", None), metavar="BASE,PER_SEQ,PER_TOKEN",
                        help="no model forward: each step sleeps BASE + PER_SEQ x sequences + PER_TOKEN x tokens seconds "
                             "(scale measurements, bench/scale.py; calibrate with bench/scale.py --calibrate)")
    for action in actions:
        action.help = f"{action.help or ''} (default: %(default)s; env PAGEDSERVE_{action.dest.upper()})".lstrip()
    return actions


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags ``args`` holds that differ from the defaults, as a command line (what
    ``serve`` passes on to the workers it starts)."""
    argv: list[str] = []
    for action in add_engine_args(argparse.ArgumentParser(add_help=False), {}):
        value = getattr(args, action.dest)
        flag = action.option_strings[0]
        if value == action.default:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif action.nargs == 0:
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {
        "dtype": args.dtype, "device": args.device, "block_size": args.block_size, "kv_cache_memory": args.kv_cache_memory,
        "num_gpu_blocks": args.num_gpu_blocks, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len,
        "preemption_mode": args.preemption_mode, "gpu_memory_utilization": args.gpu_memory_utilization,
        "enforce_eager": args.enforce_eager, "attention_backend": args.attention_backend,
        "enable_prefix_caching": args.enable_prefix_caching, "swap_space": int(args.swap_space * (1 << 30)),
        "simulate": args.simulate,
    }


def worker_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    environ = os.environ if environ is None else environ
    e = lambda name, default, kind=str: env_default(environ, name, default, kind)  # noqa: E731
    p = argparse.ArgumentParser(prog="pagedserve worker", description="Serve one model from a Redis request stream.")
    p.add_argument("--model", default=e("model", None), help="local directory or hub id (default: the demo model)")
    p.add_argument("--redis-url", default=e("redis_url", "redis://127.0.0.1:6379/0"))
    p.add_argument("--served-model-name", default=e("served_model_name", None), help="stream name (default: --model)")
    p.add_argument("--consumer", default=e("consumer", socket.gethostname()),
                   help="stable consumer name (default: the host name); each worker on a host needs its own")
    p.add_argument("--max-inflight", type=_positive(int), default=e("max_inflight", None, int),
                   help="requests held at once (default: --max-num-seqs)")
    p.add_argument("--read-ahead", type=_positive(int), default=e("read_ahead", 16, int),
                   help="requests read from the stream but not started yet, at most: a worker takes only what it can "
                        "start soon and leaves the rest to other workers (higher ramps one worker up faster)")
    p.add_argument("--claim-idle-ms", type=_positive(int), default=e("claim_idle_ms", 30_000, int),
                   help="reclaim another worker's entries idle this long")
    p.add_argument("--heartbeat", type=_positive(float), default=e("heartbeat", 1.0, float),
                   help="seconds; a worker silent for three heartbeats is taken for dead and its requests taken over")
    p.add_argument("--max-deliveries", type=_positive(int), default=e("max_deliveries", 3, int))
    p.add_argument("--drain-timeout", type=_positive(float), default=e("drain_timeout", 30.0, float), help="seconds")
    p.add_argument("--key-prefix", default=e("key_prefix", "pagedserve"))
    p.add_argument("--metrics-port", type=int, default=e("metrics_port", 0, int), help="Prometheus port (0: off)")
    p.add_argument("--metrics-host", default=e("metrics_host", "127.0.0.1"),
                   help="address of the Prometheus endpoint (0.0.0.0 to expose it beyond this host)")
    p.add_argument("--log-stats-interval", type=_non_negative(float), default=e("log_stats_interval", 10.0, float),
                   help="seconds between stats log lines (throughput, batch, KV usage, prefix hits) while busy; 0: none")
    add_engine_args(p, environ)
    return p


def worker_settings(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> WorkerSettings:
    args = worker_parser(environ).parse_args(argv)
    if args.heartbeat * 1000 >= args.claim_idle_ms:
        raise SystemExit("pagedserve: --heartbeat must be shorter than --claim-idle-ms, or live work gets reclaimed")
    return WorkerSettings(
        model=args.model, redis_url=args.redis_url, served_model_name=served_name(args.model, args.served_model_name),
        consumer=args.consumer, max_inflight=args.max_inflight or args.max_num_seqs,
        claim_idle_ms=args.claim_idle_ms, heartbeat_s=args.heartbeat, max_deliveries=args.max_deliveries,
        drain_timeout_s=args.drain_timeout, key_prefix=args.key_prefix, metrics_port=args.metrics_port,
        metrics_host=args.metrics_host, read_ahead=args.read_ahead, log_stats_interval_s=args.log_stats_interval,
        engine=engine_kwargs(args),
    )


@dataclass(frozen=True)
class GatewaySettings:
    model: str | None  # where the tokenizer and config come from (local directory, hub id; None: the demo model)
    served_model_name: str
    redis_url: str
    host: str
    port: int
    gateway_id: str
    api_keys: tuple[str, ...]
    max_body_bytes: int
    max_queue_depth: int
    request_timeout_s: float
    max_n: int
    max_tokens: int
    default_chat_max_tokens: int
    cors_origins: tuple[str, ...]
    key_prefix: str
    generation_config: str = "auto"  # "auto": the model's generation_config.json fills unset fields; "vllm": ignore it
    tool_call_parser: str = "hermes"  # how tool calls are found in a model's text (gateway/tool_calls.py)
    routing: str = "prefix"  # "prefix": to the worker holding the prompt's prefix (gateway/router.py); "shared"
    routing_load_weight: float = 1.0
    routing_busy_waiting: int = 8
    routing_imbalance: int = 16


def gateway_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    environ = os.environ if environ is None else environ
    e = lambda name, default, kind=str: env_default(environ, name, default, kind)  # noqa: E731
    p = argparse.ArgumentParser(prog="pagedserve gateway", description="OpenAI-compatible HTTP gateway in front of Redis.")
    p.add_argument("--model", default=e("model", None), help="tokenizer/config source (default: the demo model)")
    p.add_argument("--served-model-name", default=e("served_model_name", None), help="model name clients use (default: --model)")
    p.add_argument("--redis-url", default=e("redis_url", "redis://127.0.0.1:6379/0"))
    p.add_argument("--host", default=e("host", "127.0.0.1"))
    p.add_argument("--port", type=int, default=e("port", 8000, int))
    p.add_argument("--gateway-id", default=e("gateway_id", f"{socket.gethostname()}-{os.getpid()}"))
    p.add_argument("--api-key", action="append", default=None, help="accepted bearer key (repeatable); env PAGEDSERVE_API_KEY, comma-separated")
    p.add_argument("--max-body-bytes", type=_positive(int), default=e("max_body_bytes", 1 << 20, int))
    p.add_argument("--max-queue-depth", type=_positive(int), default=e("max_queue_depth", 1000, int), help="429 above this")
    p.add_argument("--request-timeout", type=_positive(float), default=e("request_timeout", 600.0, float), help="seconds")
    p.add_argument("--max-n", type=_positive(int), default=e("max_n", 16, int))
    p.add_argument("--max-tokens", type=_positive(int), default=e("max_tokens", 4096, int))
    p.add_argument("--default-chat-max-tokens", type=_positive(int), default=e("default_chat_max_tokens", 256, int))
    p.add_argument("--cors-origin", action="append", default=None, help="allowed CORS origin (repeatable; default: none)")
    p.add_argument("--key-prefix", default=e("key_prefix", "pagedserve"))
    p.add_argument("--generation-config", choices=["auto", "vllm"], default=e("generation_config", "auto"),
                   help="auto: sampling defaults from the model's generation_config.json for unset request fields; "
                        "vllm: ignore it")
    p.add_argument("--tool-call-parser", choices=["hermes", "llama3_json"], default=e("tool_call_parser", "hermes"),
                   help="the model's tool-call format, for tool_choice auto: hermes (Hermes, Qwen) or llama3_json")
    p.add_argument("--routing", choices=["prefix", "shared"], default=e("routing", "prefix"),
                   help="prefix: each request to the worker whose prefix cache holds most of its prompt, unless it is busy; "
                        "shared: every request on the model's shared stream (whichever worker reads first)")
    p.add_argument("--routing-load-weight", type=_non_negative(float), default=e("routing_load_weight", 1.0, float),
                   help="how much a worker's load (running + waiting, over max_num_seqs) counts against its cached prefix")
    p.add_argument("--routing-busy-waiting", type=_positive(int), default=e("routing_busy_waiting", 8, int),
                   help="a worker with this many requests waiting gets no routed requests (they go to the shared stream)")
    p.add_argument("--routing-imbalance", type=_positive(int), default=e("routing_imbalance", 16, int),
                   help="nor does one holding this many more requests than the least loaded worker")
    return p


def gateway_settings(argv: list[str] | None = None, environ: Mapping[str, str] | None = None) -> GatewaySettings:
    environ = os.environ if environ is None else environ
    args = gateway_parser(environ).parse_args(argv)
    keys = args.api_key or [k for k in environ.get("PAGEDSERVE_API_KEY", "").split(",") if k]
    return GatewaySettings(
        model=args.model, served_model_name=served_name(args.model, args.served_model_name), redis_url=args.redis_url,
        host=args.host, port=args.port, gateway_id=args.gateway_id, api_keys=tuple(keys),
        max_body_bytes=args.max_body_bytes, max_queue_depth=args.max_queue_depth, request_timeout_s=args.request_timeout,
        max_n=args.max_n, max_tokens=args.max_tokens, default_chat_max_tokens=args.default_chat_max_tokens,
        cors_origins=tuple(args.cors_origin or ()), key_prefix=args.key_prefix, generation_config=args.generation_config,
        tool_call_parser=args.tool_call_parser, routing=args.routing, routing_load_weight=args.routing_load_weight,
        routing_busy_waiting=args.routing_busy_waiting, routing_imbalance=args.routing_imbalance,
    )
