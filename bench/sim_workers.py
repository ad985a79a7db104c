"""Several simulated workers in one process (``--simulate``: the real scheduler, block manager,
prefix cache, KV events and Redis I/O; the forward pass a calibrated sleep), for ``bench/scale.py``:
32 worker processes would each load torch, which these machines cannot spare.

    python -m bench.sim_workers --redis-url URL --names w0,w1 --simulate BASE,PER_SEQ,PER_TOKEN [--model DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import signal

from pagedserve.worker.engine import Engine
from pagedserve.worker.serve.service import WorkerService
from pagedserve.worker.serve.settings import WorkerSettings
from pagedserve.worker.setup.engine_config import EngineConfig
from pagedserve.worker.source.resolve import model_or_default


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--redis-url", required=True)
    p.add_argument("--names", required=True, help="comma-separated consumer names, one worker each")
    p.add_argument("--simulate", required=True)
    p.add_argument("--model", default="demo")
    p.add_argument("--served-model-name", default="demo")
    p.add_argument("--num-gpu-blocks", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=32)
    return p.parse_args(argv)


async def main(args: argparse.Namespace) -> int:
    model = model_or_default(args.model)
    services = []
    for name in args.names.split(","):
        engine = Engine(EngineConfig(model=model, simulate=args.simulate, num_gpu_blocks=args.num_gpu_blocks,
                                     max_num_seqs=args.max_num_seqs))
        services.append(WorkerService(WorkerSettings(
            model=model, redis_url=args.redis_url, served_model_name=args.served_model_name, consumer=name,
            max_inflight=args.max_num_seqs, claim_idle_ms=30_000, heartbeat_s=1.0, max_deliveries=3,
            drain_timeout_s=10.0, key_prefix="pagedserve", log_stats_interval_s=0), engine))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: [s.request_stop() for s in services])
    codes = await asyncio.gather(*(s.run() for s in services))
    return max(codes)


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main(parse_args())))
