"""The GPU check's first step (``bench/gpu_check.sh``), meant to fail loudly within seconds rather
than minutes into the device's time: versions, the device and its capability, and an import of
every pagedserve module and every package the check needs. Prints one JSON line; exit 1 if
anything is missing.

    python -m pagedserve.bench.gpu_preflight
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import time

NEEDED = ("torch", "triton", "transformers", "aiohttp", "msgpack", "structlog", "redis", "prometheus_client",
          "llguidance", "gguf", "pytest", "pytest_timeout", "hypothesis")


def unmet_requirements() -> dict[str, str]:
    """pagedserve's own requirements (its installed metadata) that the installed versions miss:
    the image's packages are not the project's pins (llguidance 1.6 took one EOS token, not a list)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    unmet = {}
    for line in metadata.requires("pagedserve") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra's requirement
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            continue  # reported by the imports below where the check needs it
        if not req.specifier.contains(version, prereleases=True):
            unmet[req.name] = f"{version}, needs {req.specifier}"
    return unmet


def main() -> int:
    started = time.perf_counter()
    report: dict = {"bench": "gpu_preflight", "python": sys.version.split()[0], "missing": {}}
    for name in NEEDED:
        try:
            module = importlib.import_module(name)
            report[name] = getattr(module, "__version__", "?")
        except Exception as err:  # noqa: BLE001 - every failure is the report's
            report["missing"][name] = f"{type(err).__name__}: {err}"
    report["unmet"] = unmet_requirements()
    report["missing"].update({name: f"installed {why}" for name, why in report["unmet"].items()})
    import pagedserve

    for info in pkgutil.walk_packages(pagedserve.__path__, "pagedserve."):
        if info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except Exception as err:  # noqa: BLE001
            report["missing"][info.name] = f"{type(err).__name__}: {err}"
    try:
        import torch

        report["cuda"] = torch.version.cuda
        report["device"] = torch.cuda.get_device_name(0)
        report["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    except Exception as err:  # noqa: BLE001
        report["missing"]["cuda device"] = f"{type(err).__name__}: {err}"
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(report))
    for name, why in report["missing"].items():
        print(f"gpu_preflight: {name}: {why}", file=sys.stderr)
    return 1 if report["missing"] else 0


if __name__ == "__main__":
    sys.exit(main())
