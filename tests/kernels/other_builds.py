"""The kernels' sources built for another instruction set than this CPU's (AVX2 only, plain x86-64),
so that the paths this machine would otherwise never run are held to the same reference."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from pagedserve.kernels.native_build import FLAGS, SOURCE_DIR
from pagedserve.kernels.native_layer_ops import NativeLayerOps


def built_for(arch: str, sources: tuple[str, ...], names: tuple[str, ...], folder: Path) -> NativeLayerOps:
    """``sources`` (files of ``csrc/``) built with the kernels' own flags but ``-march=arch``
    ("haswell": AVX2 and FMA; "x86-64": the plain C loops), their ``names`` bound; skips where this
    machine cannot build or run that."""
    if arch == "haswell" and "avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no AVX2 here")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler here")
    library = folder / f"{arch}.so"
    flags = [f for f in FLAGS if not f.startswith("-march")]
    subprocess.run([compiler, *flags, f"-march={arch}", "-o", str(library), *(str(SOURCE_DIR / s) for s in sources), "-lm"],
                   check=True)
    return NativeLayerOps(ctypes.CDLL(str(library)), names=names)
