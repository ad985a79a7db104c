"""``python -m pagedserve.worker`` / ``pagedserve worker``: serve one model from its Redis request stream."""

from __future__ import annotations

import sys

from pagedserve.runtime.logging import configure_logging


def main(argv: list[str] | None = None) -> int:
    from pagedserve.worker.engine import Engine
    from pagedserve.worker.runner.device.failures import DeviceFailure
    from pagedserve.worker.serve.bridge import ConsumerNameTaken
    from pagedserve.worker.serve.process import serve_on_main_thread
    from pagedserve.worker.serve.service import WorkerService
    from pagedserve.worker.serve.settings import worker_settings
    from pagedserve.worker.setup.engine_config import EngineConfig
    from pagedserve.worker.source.resolve import model_or_default

    settings = worker_settings(argv)
    configure_logging()
    try:
        engine = Engine(EngineConfig(model=model_or_default(settings.model), **settings.engine))
    except (ValueError, OSError) as err:  # a missing model, bad engine settings, no memory for the KV pool
        print(f"pagedserve worker: cannot start: {err}", file=sys.stderr)
        return 2
    except DeviceFailure as err:  # a tensor-parallel rank that failed to start (out of memory, a broken device)
        print(f"pagedserve worker: cannot start: {err}; exiting for a restart", file=sys.stderr)
        return 3

    try:
        return serve_on_main_thread(WorkerService(settings, engine))
    except ConsumerNameTaken as err:
        print(f"pagedserve: {err}", file=sys.stderr)
        return 2
    except DeviceFailure as err:  # its requests stay pending: other workers (or this one, restarted) resume them
        print(f"pagedserve worker: {err}; exiting for a restart", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
