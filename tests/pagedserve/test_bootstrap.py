"""``make up`` / ``make test`` set-up (scripts/bootstrap.sh): a second run installs nothing."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bootstrap.sh"


def run(*args, venv: Path):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "VENV": str(venv), "HOME": str(venv)})


def test_a_second_run_with_nothing_changed_installs_nothing():
    venv = Path(sys.prefix)
    if not (venv / ".pagedserve-dev").exists():
        pytest.skip("this environment was not set up by `make test`")
    result = run("dev", venv=venv)
    assert result.returncode == 0, result.stderr
    assert result.stdout == result.stderr == ""  # no step ran


def test_without_a_usable_python_it_says_which_it_needs(tmp_path):
    tools = tmp_path / "bin"  # the script's tools, and no Python at all
    tools.mkdir()
    for tool in ("cat", "sha256sum", "cut", "dirname"):
        (tools / tool).symlink_to(shutil.which(tool))
    result = subprocess.run([shutil.which("bash"), str(SCRIPT), "dev"], capture_output=True, text=True, timeout=60,
                            env={"PATH": str(tools), "VENV": str(tmp_path / "venv"), "PYTHON": "no-such-python"})
    assert result.returncode != 0
    assert "needs Python 3.10, 3.11 or 3.12" in result.stderr


def test_an_unknown_profile_is_refused(tmp_path):
    result = run("deploy", venv=tmp_path)
    assert result.returncode == 2 and "unknown profile 'deploy'" in result.stderr
