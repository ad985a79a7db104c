"""``python -m worker`` / ``pagedserve worker``: serve one model from its Redis request stream."""

from __future__ import annotations

import sys

from shared.logging import configure_logging


def main(argv: list[str] | None = None) -> int:
    from shared.model_source import model_or_demo
    from shared.settings import worker_settings
    from worker.engine import Engine
    from worker.core.engine_config import EngineConfig
    from worker.serve.bridge import ConsumerNameTaken
    from worker.serve.process import serve_on_main_thread
    from worker.serve.service import WorkerService

    settings = worker_settings(argv)
    configure_logging()
    try:
        engine = Engine(EngineConfig(model=model_or_demo(settings.model), **settings.engine))
    except (ValueError, OSError) as err:  # a missing model, bad engine settings, no memory for the KV pool
        print(f"pagedserve worker: cannot start: {err}", file=sys.stderr)
        return 2

    try:
        return serve_on_main_thread(WorkerService(settings, engine))
    except ConsumerNameTaken as err:
        print(f"pagedserve: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
