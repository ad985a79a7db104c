"""Compiling the C kernels in ``paged_kernels/csrc`` for the CPU they run on, once per machine.

The library is built with the system C compiler (``cc -O3 -march=native -fopenmp``) into
the caller's cache directory (the engine passes ``<pagedserve cache>/kernels``), keyed by the source, the compiler and the
CPU's feature flags, so a second start loads it in milliseconds and a changed source or another
machine sharing the cache builds anew.
It links ``libgomp.so.1``, which resolves to the OpenMP runtime torch has already loaded, so the
kernels and torch share one thread pool. No compiler, or a failed build, is a
``NativeKernelUnavailable`` with the reason; ``kernels.ops`` then uses the torch references.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE_DIR = Path(__file__).parent / "csrc"
# -ffp-contract=fast: a * b + c as one fused multiply-add (-std=c11 alone keeps them apart, half the
# speed); -fno-trapping-math: the clamps in fast_expf's loops may become vector selects (with traps
# honoured they stay branches and the whole softmax runs a lane at a time). No kernel reads FP flags.
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-std=c11")
BUILD_TIMEOUT_S = 120


class NativeKernelUnavailable(RuntimeError):
    """The C kernels cannot be built or loaded here (the message says why)."""


def load_library(name: str, cache_dir: Path) -> ctypes.CDLL:
    """Every ``csrc/*.c`` (which share ``csrc/*.h``) compiled for this machine into one library called
    ``name`` (built into ``cache_dir`` on first use) and loaded."""
    import torch.nn  # noqa: F401  (torch's libgomp must be loaded first, so ours resolves to it)

    sources = sorted(SOURCE_DIR.glob("*.c"))
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NativeKernelUnavailable("no C compiler (cc or gcc) on PATH")
    target = _cached_path(name, sources, compiler, cache_dir)
    if not target.exists():
        _compile(compiler, sources, target)
    try:
        return ctypes.CDLL(str(target))
    except OSError as err:
        raise NativeKernelUnavailable(f"cannot load {target}: {err}") from err


def _cached_path(name: str, sources: list[Path], compiler: str, cache_dir: Path) -> Path:
    key = hashlib.sha256()
    for path in [*sources, *sorted(SOURCE_DIR.glob("*.h"))]:  # the sources and what they include
        key.update(path.name.encode() + b"\0" + path.read_bytes())
    key.update(" ".join(FLAGS).encode())
    key.update(_compiler_version(compiler).encode())
    key.update(_cpu_flags().encode())
    key.update(torch.__version__.encode())
    return cache_dir / f"{name}-{key.hexdigest()[:16]}.so"


def _compile(compiler: str, sources: list[Path], target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise NativeKernelUnavailable(f"cannot create the kernel cache {target.parent}: {err}") from err
    names = ", ".join(path.name for path in sources)
    # Build beside the target and rename: concurrent workers never load a half-written library.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", partial, *map(str, sources), "-lm"], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise NativeKernelUnavailable(f"{compiler} failed on {names}: {done.stderr.strip()[-800:]}")
        os.replace(partial, target)
    except subprocess.TimeoutExpired as err:
        raise NativeKernelUnavailable(f"{compiler} took over {BUILD_TIMEOUT_S} s on {names}") from err
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _compiler_version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise NativeKernelUnavailable(f"cannot run {compiler}: {err}") from err


def _cpu_flags() -> str:
    """The CPU's feature flags (``-march=native`` output differs between machines)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return ""
