"""The environment, read in one place: ``PAGEDSERVE_<NAME>`` (``REDIS_URL`` for the Redis URL)
as a flag's default, the cache directory, and the argparse types every service's flags use.

Each service builds its frozen settings once from its flags, whose defaults come from here
(``gateway/service/settings.py``, ``worker/serve/settings.py``, the engine's in ``worker/setup/engine_flags.py``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable, Mapping

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def env_name(name: str) -> str:
    """The variable that sets flag ``name`` (its argparse dest)."""
    return "REDIS_URL" if name == "redis_url" else f"PAGEDSERVE_{name.upper()}"


def env_default(environ: Mapping[str, str], name: str, default, kind: Callable = str):
    """``env_name(name)`` converted to ``kind``, else ``default``."""
    key = env_name(name)
    raw = environ.get(key)
    if raw is None or raw == "":
        return default
    try:
        return kind(raw)
    except (ValueError, argparse.ArgumentTypeError):
        raise SystemExit(f"pagedserve: {key}={raw!r} is not a valid {getattr(kind, '__name__', 'value')}") from None


def redis_url_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    return env_default(os.environ if environ is None else environ, "redis_url", None)


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where built models and compiled CPU kernels live: ``PAGEDSERVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/pagedserve``, else ``~/.cache/pagedserve``."""
    environ = os.environ if environ is None else environ
    if environ.get("PAGEDSERVE_CACHE_DIR"):
        return Path(environ["PAGEDSERVE_CACHE_DIR"])
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedserve"


def checked(kind, ok, rule: str):
    """An argparse type: ``kind(text)``, refused with ``must be <rule>`` unless ``ok(value)``."""
    def parse(text: str):
        value = kind(text)
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def positive(kind):
    return checked(kind, lambda v: v > 0, "> 0")


def non_negative(kind):
    return checked(kind, lambda v: v >= 0, ">= 0")


fraction = checked(float, lambda v: 0 < v <= 1, "in (0, 1]")


def boolean(text: str) -> bool:
    if text.lower() not in ("1", "true", "yes", "0", "false", "no"):
        raise ValueError(text)
    return text.lower() in ("1", "true", "yes")


def with_env_help(actions) -> None:
    """End each flag's help with its default (unless the help says it in words) and its
    environment variable."""
    for action in actions:
        said = "default:" in (action.help or "")
        tail = f"(env {env_name(action.dest)})" if said else f"(default: %(default)s; env {env_name(action.dest)})"
        action.help = f"{action.help or ''} {tail}".lstrip()
