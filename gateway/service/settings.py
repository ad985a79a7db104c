"""The gateway's settings: its flags, then the environment (``runtime/env.py``), then defaults;
built once, frozen."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from typing import Callable, Mapping

from pagedserve.gateway.answers.reasoning import PARSERS as REASONING_PARSERS
from pagedserve.runtime.env import DEFAULT_REDIS_URL, env_default, non_negative, positive, with_env_help
from pagedserve.shared.keys import served_name


@dataclass(frozen=True)
class GatewaySettings:
    model: str  # where the tokenizer and generation_config.json come from: a local directory or hub id
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
    tool_call_parser: str = "hermes"  # how tool calls are found in a model's text (gateway/answers/tool_calls.py)
    responses_ttl_s: float = 3600.0  # how long a stored Responses API answer is kept (gateway/routes/responses.py)
    reasoning_parser: str | None = None  # how a thinking model's reasoning is split from its answer (gateway/answers/reasoning.py)
    routing: str = "prefix"  # "prefix": to the worker holding the prompt's prefix (gateway/routing/router.py); "shared"
    routing_load_weight: float = 1.0
    routing_busy_waiting: int = 8
    routing_imbalance: int = 16
    outage_grace_s: float = 30.0  # Redis unreachable longer than this: held requests end with a 503 (runtime/outage.py)
    drain_timeout_s: float = 30.0  # SIGTERM: the longest the requests held are waited for before they are cut


def gateway_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    environ = os.environ if environ is None else environ
    e = lambda name, default, kind=str: env_default(environ, name, default, kind)  # noqa: E731
    p = argparse.ArgumentParser(prog="pagedserve gateway", description="OpenAI-compatible HTTP gateway in front of Redis.")
    p.add_argument("--model", default=e("model", None), help="tokenizer/config source: a model directory, GGUF file or hub id (default: the default model)")
    p.add_argument("--served-model-name", default=e("served_model_name", None), help="model name clients use (default: --model)")
    p.add_argument("--redis-url", default=e("redis_url", DEFAULT_REDIS_URL),
                   help="the Redis the workers read (redis+cluster://host:port for a cluster)")
    p.add_argument("--host", default=e("host", "127.0.0.1"), help="address to listen on")
    p.add_argument("--port", type=int, default=e("port", 8000, int), help="port to listen on")
    p.add_argument("--gateway-id", default=e("gateway_id", f"{socket.gethostname()}-{os.getpid()}"),
                   help="this gateway's name: its reply channel, in logs (default: host name and process id)")
    p.add_argument("--api-key", action="append", default=None, help="accepted bearer key (repeatable); env PAGEDSERVE_API_KEY, comma-separated")
    p.add_argument("--max-body-bytes", type=positive(int), default=e("max_body_bytes", 1 << 20, int),
                   help="a larger request body is a 413")
    p.add_argument("--max-queue-depth", type=positive(int), default=e("max_queue_depth", 1000, int), help="429 above this")
    p.add_argument("--request-timeout", type=positive(float), default=e("request_timeout", 600.0, float), help="seconds")
    p.add_argument("--max-n", type=positive(int), default=e("max_n", 16, int), help="the largest n (or best_of) a request may ask")
    p.add_argument("--max-tokens", type=positive(int), default=e("max_tokens", 4096, int),
                   help="the largest max_tokens a request may ask")
    p.add_argument("--default-chat-max-tokens", type=positive(int), default=e("default_chat_max_tokens", 256, int),
                   help="max_tokens of a chat completion that gives none")
    p.add_argument("--cors-origin", action="append", default=None, help="allowed CORS origin (repeatable; default: none)")
    p.add_argument("--key-prefix", default=e("key_prefix", "pagedserve"),
                   help="the first part of every Redis key (deployments sharing one Redis)")
    p.add_argument("--generation-config", choices=["auto", "vllm"], default=e("generation_config", "auto"),
                   help="auto: sampling defaults from the model's generation_config.json for unset request fields; "
                        "vllm: ignore it")
    p.add_argument("--tool-call-parser", choices=["hermes", "llama3_json"], default=e("tool_call_parser", "hermes"),
                   help="the model's tool-call format, for tool_choice auto: hermes (Hermes, Qwen) or llama3_json")
    p.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=e("reasoning_parser", None),
                   help="split a thinking model's <think>...</think> into reasoning_content: deepseek_r1 or qwen3 "
                        "(default: none, the thinking stays in the content)")
    p.add_argument("--responses-ttl", type=positive(float), default=e("responses_ttl", 3600.0, float),
                   help="seconds a stored /v1/responses answer is kept for GET and previous_response_id")
    p.add_argument("--routing", choices=["prefix", "shared"], default=e("routing", "prefix"),
                   help="prefix: each request to the worker whose prefix cache holds most of its prompt, unless it is busy; "
                        "shared: every request on the model's shared stream (whichever worker reads first)")
    p.add_argument("--routing-load-weight", type=non_negative(float), default=e("routing_load_weight", 1.0, float),
                   help="how much a worker's load (running + waiting, over max_num_seqs) counts against its cached prefix")
    p.add_argument("--routing-busy-waiting", type=positive(int), default=e("routing_busy_waiting", 8, int),
                   help="a worker with this many requests waiting gets no routed requests (they go to the shared stream)")
    p.add_argument("--routing-imbalance", type=positive(int), default=e("routing_imbalance", 16, int),
                   help="nor does one holding this many more requests than the least loaded worker")
    p.add_argument("--outage-grace", type=positive(float), default=e("outage_grace", 30.0, float),
                   help="seconds Redis may be unreachable (a restart, a failover) before the requests held end "
                        "with a 503 error instead of waiting for it")
    p.add_argument("--drain-timeout", type=positive(float), default=e("drain_timeout", 30.0, float),
                   help="seconds SIGTERM waits for the requests held to finish (at once while Redis is unreachable)")
    with_env_help([a for a in p._actions[1:] if a.dest not in ("api_key", "cors_origin")])  # those say their own
    return p


def gateway_settings(argv: list[str] | None = None, environ: Mapping[str, str] | None = None,
                     resolve: Callable[[str | None], str] | None = None) -> GatewaySettings:
    """``resolve``: the model as given (None: not given) -> where its tokenizer lives; the gateway
    does not know how models are found (``pagedserve gateway`` hands it the worker's way)."""
    environ = os.environ if environ is None else environ
    args = gateway_parser(environ).parse_args(argv)
    keys = args.api_key or [k for k in environ.get("PAGEDSERVE_API_KEY", "").split(",") if k]
    model = resolve(args.model) if resolve else args.model
    if not model:
        raise SystemExit("pagedserve gateway: --model names the model (a local directory or hub id) whose tokenizer to use")
    return GatewaySettings(
        model=model, served_model_name=served_name(args.model, args.served_model_name), redis_url=args.redis_url,
        host=args.host, port=args.port, gateway_id=args.gateway_id, api_keys=tuple(keys),
        max_body_bytes=args.max_body_bytes, max_queue_depth=args.max_queue_depth, request_timeout_s=args.request_timeout,
        max_n=args.max_n, max_tokens=args.max_tokens, default_chat_max_tokens=args.default_chat_max_tokens,
        cors_origins=tuple(args.cors_origin or ()), key_prefix=args.key_prefix, generation_config=args.generation_config,
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
        responses_ttl_s=args.responses_ttl, routing=args.routing, routing_load_weight=args.routing_load_weight,
        routing_busy_waiting=args.routing_busy_waiting, routing_imbalance=args.routing_imbalance,
        outage_grace_s=args.outage_grace, drain_timeout_s=args.drain_timeout,
    )
