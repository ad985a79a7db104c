"""``python -m worker`` / ``pagedserve worker``: serve one model from its Redis request stream."""

from __future__ import annotations

import asyncio
import signal
import sys

from shared.logging import configure_logging


def main(argv: list[str] | None = None) -> int:
    from shared.settings import worker_settings
    from worker.engine import Engine
    from worker.engine_config import EngineConfig
    from worker.service import WorkerService

    settings = worker_settings(argv)
    configure_logging()
    engine = Engine(EngineConfig(model=settings.model, **settings.engine))

    async def serve() -> int:
        service = WorkerService(settings, engine)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.request_stop)
        return await service.run()

    return asyncio.run(serve())


if __name__ == "__main__":
    sys.exit(main())
