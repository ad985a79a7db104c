"""The engine's command-line flags, made from ``EngineConfig``'s declarations (``flag(...)`` in
``worker/setup/engine_config.py``): the options with their help and environment variables
(``pagedserve worker`` and ``pagedserve serve`` both take them), the ``EngineConfig`` keyword
arguments a parsed command line gives, and the argv ``serve`` passes on to its workers."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from typing import Iterator, Mapping

from pagedserve.runtime.env import boolean, env_default, with_env_help
from pagedserve.worker.setup.engine_config import EngineConfig, Flag


def declared_flags() -> Iterator[tuple[str, Flag, object]]:
    """(setting name, how it is given, its default in flag units) for every declared flag."""
    for f in fields(EngineConfig):
        how = f.metadata.get("flag")
        if how is not None and f.default is not MISSING:
            default = f.default if how.served is None else how.served
            yield f.name, how, default / how.unit if how.unit != 1 and default is not None else default


def add_engine_args(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> list[argparse.Action]:
    """Add the engine's flags to ``parser`` (defaults from ``environ``); returns their actions."""
    actions = []
    for name, how, default in declared_flags():
        option = "--" + name.replace("_", "-")
        if how.switch:
            default = env_default(environ, name, default, boolean)
            action = argparse.BooleanOptionalAction if how.switch == "both" else "store_true"
            actions.append(parser.add_argument(option, action=action, default=default, help=how.help or None))
            continue
        kind = (lambda raw: tuple(raw.split())) if how.many else how.kind or str
        actions.append(parser.add_argument(option, type=how.kind, choices=how.choices, metavar=how.metavar,
                                           nargs="+" if how.many else None,
                                           default=env_default(environ, name, default, kind), help=how.help or None))
    with_env_help(actions)
    return actions


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The ``EngineConfig`` keyword arguments a parsed command line holds (model aside)."""
    kwargs = {}
    for name, how, _ in declared_flags():
        value = getattr(args, name)
        kwargs[name] = int(value * how.unit) if how.unit != 1 and value is not None else tuple(value) if how.many else value
    return kwargs


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags ``args`` holds that differ from the defaults, as a command line (what
    ``serve`` passes on to the workers it starts)."""
    argv: list[str] = []
    for name, how, default in declared_flags():
        value, option = getattr(args, name), "--" + name.replace("_", "-")
        if value == default:
            continue
        if how.switch == "both":
            argv.append(option if value else f"--no-{option[2:]}")
        elif how.many:
            argv += [option, *value]
        elif how.switch:
            argv.append(option)
        else:
            argv += [option, str(value)]
    return argv
