"""``python -m gateway`` / ``pagedserve gateway``: the OpenAI-compatible HTTP front end."""

from __future__ import annotations

import sys

from aiohttp import web

from shared.logging import configure_logging


def main(argv: list[str] | None = None) -> int:
    from gateway.app import create_app
    from shared.settings import gateway_settings

    settings = gateway_settings(argv)
    configure_logging()
    app = create_app(settings)
    # handler_cancellation: a client that disconnects cancels its handler, which cancels its requests.
    web.run_app(app, host=settings.host, port=settings.port, handler_cancellation=True, print=None,
                shutdown_timeout=10.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
