"""The worker's settings: its flags (the engine's among them, ``worker/setup/engine_flags.py``), then the
environment (``runtime/env.py``), then defaults; built once, frozen."""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass, field
from typing import Mapping

from pagedserve.runtime.env import DEFAULT_REDIS_URL, env_default, non_negative, positive, with_env_help
from pagedserve.shared.keys import served_name
from pagedserve.worker.setup.engine_flags import add_engine_args, engine_kwargs
from pagedserve.worker.source.resolve import MODEL_HELP


@dataclass(frozen=True)
class WorkerSettings:
    model: str | None  # None: the default model (worker/source/resolve.py, model_or_default)
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
    outage_grace_s: float = 30.0  # Redis unreachable longer than this: the requests held are let go (runtime/outage.py)

    @property
    def liveness_s(self) -> float:
        """The liveness key's time to live: three heartbeats (a worker silent that long is taken for dead)."""
        return self.heartbeat_s * 3


def worker_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    environ = os.environ if environ is None else environ
    e = lambda name, default, kind=str: env_default(environ, name, default, kind)  # noqa: E731
    p = argparse.ArgumentParser(prog="pagedserve worker", description="Serve one model from a Redis request stream.")
    p.add_argument("--model", default=e("model", None), help=MODEL_HELP)
    p.add_argument("--redis-url", default=e("redis_url", DEFAULT_REDIS_URL),
                   help="the Redis holding the request streams (redis+cluster://host:port for a cluster)")
    p.add_argument("--served-model-name", default=e("served_model_name", None), help="stream name (default: --model)")
    p.add_argument("--consumer", default=e("consumer", socket.gethostname()),
                   help="stable consumer name (default: the host name); each worker on a host needs its own")
    p.add_argument("--max-inflight", type=positive(int), default=e("max_inflight", None, int),
                   help="requests held at once (default: --max-num-seqs)")
    p.add_argument("--read-ahead", type=positive(int), default=e("read_ahead", 16, int),
                   help="requests read from the stream but not started yet, at most: a worker takes only what it can "
                        "start soon and leaves the rest to other workers (higher ramps one worker up faster)")
    p.add_argument("--claim-idle-ms", type=positive(int), default=e("claim_idle_ms", 30_000, int),
                   help="reclaim another worker's entries idle this long")
    p.add_argument("--heartbeat", type=positive(float), default=e("heartbeat", 1.0, float),
                   help="seconds; a worker silent for three heartbeats is taken for dead and its requests taken over")
    p.add_argument("--max-deliveries", type=positive(int), default=e("max_deliveries", 3, int),
                   help="deliveries of one entry before it goes to the dead-letter stream (a request that kills workers)")
    p.add_argument("--drain-timeout", type=positive(float), default=e("drain_timeout", 30.0, float),
                   help="seconds SIGTERM waits for the requests held to finish and their events to go out (what is left "
                        "is aborted; with Redis unreachable, nothing is waited for)")
    p.add_argument("--outage-grace", type=positive(float), default=e("outage_grace", 30.0, float),
                   help="seconds Redis may be unreachable (a restart, a failover) before the requests held are aborted "
                        "(their blocks freed, nothing sent for them when Redis is back)")
    p.add_argument("--key-prefix", default=e("key_prefix", "pagedserve"),
                   help="the first part of every Redis key (deployments sharing one Redis)")
    p.add_argument("--metrics-port", type=int, default=e("metrics_port", 0, int), help="Prometheus port (0: off)")
    p.add_argument("--metrics-host", default=e("metrics_host", "127.0.0.1"),
                   help="address of the Prometheus endpoint (0.0.0.0 to expose it beyond this host)")
    p.add_argument("--log-stats-interval", type=non_negative(float), default=e("log_stats_interval", 10.0, float),
                   help="seconds between stats log lines (throughput, batch, KV usage, prefix hits) while busy; 0: none")
    with_env_help(p._actions[1:])  # after -h
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
        drain_timeout_s=args.drain_timeout, outage_grace_s=args.outage_grace, key_prefix=args.key_prefix, metrics_port=args.metrics_port,
        metrics_host=args.metrics_host, read_ahead=args.read_ahead, log_stats_interval_s=args.log_stats_interval,
        engine=engine_kwargs(args),
    )
