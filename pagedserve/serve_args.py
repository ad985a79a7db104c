"""The flags of ``pagedserve serve`` (alias ``up``): the whole stack in one process tree, taking the
model as ``vllm serve`` does (positional) and the engine flags vLLM users know, which it passes on
to the workers it starts. Every help line shows the default and the environment variable."""

from __future__ import annotations

import argparse
import os

from pagedserve.gateway.answers.reasoning import PARSERS as REASONING_PARSERS
from pagedserve.runtime.env import checked, env_default, non_negative, positive, with_env_help
from pagedserve.worker.setup.engine_flags import add_engine_args
from pagedserve.worker.source.resolve import MODEL_HELP

_port = checked(int, lambda v: 0 < v < 65536, "a TCP port in 1-65535")
_workers = checked(int, lambda v: v >= 1, "at least 1")


def add_serve_parser(sub) -> argparse.ArgumentParser:
    environ = os.environ
    e = lambda name, default, kind=str: env_default(environ, name, default, kind)  # noqa: E731
    serve = sub.add_parser(
        "serve", aliases=["up"], formatter_class=argparse.RawDescriptionHelpFormatter,
        help="Redis (embedded unless REDIS_URL is set), a gateway and workers, in one command",
        description="Serve MODEL over the OpenAI API: Redis (embedded unless REDIS_URL is set), a gateway and "
                    "--workers workers. Ctrl-C or SIGTERM drains and stops everything.",
        epilog="example: pagedserve serve ./my-llama --dtype bfloat16 --max-model-len 4096 --port 8000")
    serve.add_argument("model", nargs="?", default=e("model", None),
                       help=f"{MODEL_HELP}; env PAGEDSERVE_MODEL")
    serve.add_argument("--model", dest="model_option", default=None, help="the same as MODEL, for `up --model M`")
    rows = [
        ("--host", dict(default=e("host", "127.0.0.1"), help="address of the HTTP gateway")),
        ("--port", dict(type=_port, default=e("port", 8000, int), help="port of the HTTP gateway")),
        ("--workers", dict(type=_workers, default=e("workers", 1, int), help="engine workers (one model copy each)")),
        ("--served-model-name", dict(default=e("served_model_name", None), help="the name clients use (default: MODEL)")),
        ("--tool-call-parser", dict(choices=["hermes", "llama3_json"], default=e("tool_call_parser", "hermes"),
                                    help="the model's tool-call format for tool_choice auto")),
        ("--reasoning-parser", dict(choices=sorted(REASONING_PARSERS), default=e("reasoning_parser", None),
                                    help="split a thinking model's <think>...</think> into reasoning_content "
                                         "(default: none, the thinking stays in the content)")),
        ("--redis-url", dict(default=e("redis_url", None),
                             help="a Redis (or redis+cluster://) to use instead of starting one (default: start one)")),
        ("--log-stats-interval", dict(type=non_negative(float), default=e("log_stats_interval", 10.0, float),
                                      help="seconds between the workers' stats lines while busy; 0: none")),
        ("--drain-timeout", dict(type=positive(float), default=e("drain_timeout", 30.0, float),
                                 help="seconds Ctrl-C or SIGTERM waits for the requests held to finish (at once "
                                      "while Redis is unreachable); the whole stack is stopped within about 10 s more")),
        ("--outage-grace", dict(type=positive(float), default=e("outage_grace", 30.0, float),
                                help="seconds an external Redis may be unreachable before the requests held end "
                                     "with an error (their blocks freed)")),
    ]
    with_env_help([serve.add_argument(flag, **options) for flag, options in rows])
    serve.add_argument("--api-key", action="append", default=None,
                       help="bearer key clients must send (repeatable; env PAGEDSERVE_API_KEY, comma-separated)")
    add_engine_args(serve, environ)
    return serve
