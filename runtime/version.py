"""The installed pagedserve version, for ``--version`` and ``GET /version``."""

from __future__ import annotations

from importlib import metadata


def installed_version() -> str:
    try:
        return metadata.version("pagedserve")
    except metadata.PackageNotFoundError:  # a checkout that was never installed
        return "unknown"
