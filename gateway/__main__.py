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
    try:
        app = create_app(settings)
    except (ValueError, OSError) as err:  # the model (tokenizer, config) cannot be found or read
        print(f"pagedserve gateway: cannot start: {err}", file=sys.stderr)
        return 2
    try:
        # handler_cancellation: a client that disconnects cancels its handler, which cancels its requests.
        web.run_app(app, host=settings.host, port=settings.port, handler_cancellation=True, print=None,
                    shutdown_timeout=10.0)
    except OSError as err:  # the port is taken, or the address is not this host's
        print(f"pagedserve gateway: cannot listen on {settings.host}:{settings.port}: {err.strerror or err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
