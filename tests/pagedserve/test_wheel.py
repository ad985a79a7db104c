"""What ``pip install pagedserve`` puts on ``sys.path`` is one namespace: the wheel, installed into a
fresh virtual environment, offers ``pagedserve.*`` (the CLI, the offline API, the data files) and
no generic ``shared``, ``worker``, ``gateway``, ``kernels``, ``runtime`` or ``bench``.

The fresh environment borrows this one's third-party packages (torch, transformers, ...) through
a ``.pth`` line, which adds their folder without running its ``.pth`` files: the editable install
of this checkout stays out, so only the wheel can answer for ``pagedserve``."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERIC = ("shared", "worker", "gateway", "kernels", "runtime", "bench")


def run(*cmd, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, timeout=timeout)


def source_copy(into: Path) -> Path:
    """The checkout's files as git sees them (tracked, or new and not ignored), so the build leaves
    nothing in the working tree and nothing stale from an earlier build (a build/ folder) gets in."""
    listed = run("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=ROOT).stdout.split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    source = source_copy(tmp_path_factory.mktemp("source"))
    result = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", out, source, cwd=out, timeout=600)
    if result.returncode != 0 and "Could not find a version that satisfies" in result.stderr:
        pytest.skip(f"no build backend to be had here (setuptools from the package index): {result.stderr[-300:]}")
    assert result.returncode == 0, result.stderr
    [built] = out.glob("pagedserve-*.whl")
    return built


@pytest.fixture(scope="module")
def fresh(wheel, tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("fresh") / "venv"
    assert run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=venv.parent).returncode == 0
    python = venv / "bin" / "python"
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=venv).stdout.strip())
    (site / "borrowed.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    result = run(python, "-m", "pip", "install", "--no-deps", "--quiet", wheel, cwd=venv)
    assert result.returncode == 0, result.stderr
    return venv


def test_the_wheel_holds_one_namespace_and_its_data_files(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"pagedserve"}
    for data in ("pagedserve/worker/source/demo/corpus.txt", "pagedserve/gateway/static/dashboard.html",
                 "pagedserve/kernels/csrc/paged_attention.c", "pagedserve/kernels/csrc/paged_prefill.c",
                 "pagedserve/kernels/csrc/paged_common.h", "pagedserve/worker/runner/attention/texts/calibration.txt",
                 "pagedserve/worker/core/scheduling/scheduler.py"):
        assert data in names


@pytest.mark.parametrize("name", GENERIC)
def test_no_generic_package_is_importable_after_install(fresh, name, tmp_path):
    """Ours are only pagedserve.*; a generic name another dependency ships (transformers >= 5.25
    brings Hugging Face's ``kernels``) must be theirs, never this project's."""
    owners = run(fresh / "bin" / "python", "-c",
                 f"import importlib.metadata as m; print(' '.join(m.packages_distributions().get({name!r}, [])))", cwd=tmp_path)
    assert owners.returncode == 0 and "pagedserve" not in owners.stdout.split(), owners
    if owners.stdout.strip():
        return
    result = run(fresh / "bin" / "python", "-c", f"import {name}", cwd=tmp_path)
    assert result.returncode != 0 and "No module named" in result.stderr, (result.stdout, result.stderr)


def test_the_installed_command_and_offline_api_work(fresh, tmp_path):
    code = ("import pagedserve, pagedserve.worker.engine, pagedserve.gateway.app; from pagedserve import LLM; "
            "print(pagedserve.__file__, pagedserve.worker.engine.__file__, LLM.__name__)")
    result = run(fresh / "bin" / "python", "-c", code, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert all(path.startswith(str(fresh)) for path in result.stdout.split()[:2]), result.stdout  # the wheel's, not this checkout
    assert result.stdout.split()[2] == "LLM"
    help_text = run(fresh / "bin" / "pagedserve", "serve", "--help", cwd=tmp_path)
    assert help_text.returncode == 0 and "--max-model-len" in help_text.stdout, help_text.stderr
