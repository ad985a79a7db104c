"""The README's Python examples run verbatim, offline (no hub: ``HF_HUB_OFFLINE=1``), on the
default model from the cache, and say what the README says they print."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_its_offline_example():
    assert any("LLM()" in block for block in python_blocks())


@pytest.mark.slow
def test_every_python_block_runs_offline(real_model, tmp_path):
    for block in python_blocks():
        done = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        for printed in re.findall(r"print\(.*\)\s+# (.+)", block):  # "print(x)  # what it prints"
            assert printed.strip() in done.stdout, (printed, done.stdout)
