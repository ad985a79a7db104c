"""The layers import one way only (docs/architecture.md): serve -> engine -> runner -> core,
runner -> kernels; ``shared`` and ``kernels`` import no service; only ``pagedserve`` imports both."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pagedserve", "gateway", "worker", "kernels", "shared")

# A module whose path starts with the key may not import any name that starts with a banned prefix.
BANNED = {
    "shared/": ("pagedserve", "gateway", "worker", "kernels"),
    "kernels/": ("pagedserve", "gateway", "worker", "shared", "redis"),
    "worker/core/": ("torch", "redis", "transformers", "kernels", "worker.runner", "worker.serve",
                     "worker.engine", "worker.llm", "gateway", "pagedserve"),
    "worker/runner/": ("redis", "worker.serve", "worker.engine", "worker.llm", "gateway", "pagedserve"),
    "worker/engine.py": ("redis", "worker.serve", "worker.llm", "gateway", "pagedserve"),
    "worker/llm.py": ("redis", "worker.serve", "gateway", "pagedserve"),
    "worker/serve/": ("gateway", "pagedserve"),
    "worker/__main__.py": ("gateway", "pagedserve"),
    "gateway/": ("worker", "kernels", "pagedserve", "torch"),
}


def imported_names(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append((node.lineno, node.module))
    return names


def banned_for(relative: str) -> tuple[str, ...]:
    return tuple(b for prefix, bans in BANNED.items() if relative.startswith(prefix) for b in bans)


def test_no_module_imports_against_the_layers():
    upward = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            for line, name in imported_names(path):
                if any(name == b or name.startswith(b + ".") for b in banned_for(relative)):
                    upward.append(f"{relative}:{line} imports {name}")
    assert upward == []


def test_the_rule_table_catches_an_upward_import(tmp_path):
    """The checker itself: a core module importing the runner is reported."""
    module = tmp_path / "bad.py"
    module.write_text("import torch\nfrom worker.runner.sampler import Sampler\nfrom worker.core.plan import StepPlan\n")
    names = [n for _, n in imported_names(module)]
    bans = banned_for("worker/core/bad.py")
    assert [n for n in names if any(n == b or n.startswith(b + ".") for b in bans)] == ["torch", "worker.runner.sampler"]


@pytest.mark.parametrize("folder, heavy", [
    ("worker/core", ("torch", "redis", "transformers", "numpy")),
    ("shared", ("torch", "transformers")),  # the demo model imports them only when it builds one
])
def test_a_layer_loads_without_what_it_must_not_need(folder, heavy):
    modules = sorted(p.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
                     for p in (ROOT / folder).glob("*.py"))
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            f"print(','.join(sorted(m for m in {heavy!r} if m in sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_the_public_api_is_pagedserve():
    code = "import sys; from pagedserve import SamplingParams; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr
