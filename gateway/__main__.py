"""``python -m pagedserve.gateway`` / ``pagedserve gateway``: the OpenAI-compatible HTTP front end."""

from __future__ import annotations

import sys
from typing import Callable

from aiohttp import web

from pagedserve.runtime.logging import configure_logging
from pagedserve.runtime.supervision import EXIT_CUT


def main(argv: list[str] | None = None, resolve: Callable[[str | None], str] | None = None) -> int:
    """``resolve``: how the ``--model`` given becomes a tokenizer's directory (``pagedserve gateway``
    passes the worker's, which also knows the demo model); without it, a directory or hub id as is."""
    from pagedserve.gateway.app import create_app
    from pagedserve.gateway.service.generation import STATE
    from pagedserve.gateway.service.settings import gateway_settings

    configure_logging()
    try:
        settings = gateway_settings(argv, resolve=resolve)
        app = create_app(settings)
    except (ValueError, OSError) as err:  # the model (tokenizer, config) cannot be found or read
        print(f"pagedserve gateway: cannot start: {err}", file=sys.stderr)
        return 2
    try:
        # handler_cancellation: a client that disconnects cancels its handler, which cancels its requests.
        web.run_app(app, host=settings.host, port=settings.port, handler_cancellation=True, print=None,
                    shutdown_timeout=settings.drain_timeout_s)
    except OSError as err:  # the port is taken, or the address is not this host's
        print(f"pagedserve gateway: cannot listen on {settings.host}:{settings.port}: {err.strerror or err}", file=sys.stderr)
        return 2
    return EXIT_CUT if app[STATE].dispatcher.cut_at_stop else 0


if __name__ == "__main__":
    sys.exit(main())
