"""structlog set-up: readable console lines on a terminal, JSON lines otherwise (or when asked)."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(json: bool | None = None, level: int = logging.INFO) -> None:
    """``json=None``: JSON unless stderr is a terminal."""
    if json is None:
        json = not sys.stderr.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            *([structlog.processors.format_exc_info] if json else []),  # the console renderer prints tracebacks itself
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
