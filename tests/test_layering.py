"""The layers import one way only (docs/architecture.md): serve -> engine -> runner -> core,
runner -> kernels, every service -> runtime -> shared; ``shared`` imports nothing but msgpack and
the standard library; only the top of ``pagedserve`` (cli, stack, ...) imports both services.
Names count however they are spelled: an ``import``, an ``importlib.import_module`` string, or a
string naming a module (``pagedserve.cli``'s bench table). Outside the engine nothing reaches
into the scheduler: the serve layer and the benchmarks read ``Engine``'s methods."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"pagedserve": "pagedserve", "shared": "pagedserve.shared", "runtime": "pagedserve.runtime",
           "worker": "pagedserve.worker", "gateway": "pagedserve.gateway", "kernels": "pagedserve.kernels",
           "bench": "pagedserve.bench"}
SUBPACKAGES = tuple(v for v in FOLDERS.values() if v != "pagedserve")
TOP = "pagedserve"  # the package itself and its own modules (cli, stack, serve_args, embedded_redis)
SERVICES = ("pagedserve.worker", "pagedserve.gateway")

# A module whose dotted name starts with the key may not import a name that starts with a banned prefix.
BANNED = {
    "pagedserve.shared": (TOP, "pagedserve.runtime", *SERVICES, "pagedserve.kernels", "pagedserve.bench"),
    "pagedserve.runtime": (TOP, *SERVICES, "pagedserve.kernels", "pagedserve.bench", "torch"),
    "pagedserve.kernels": (TOP, *SERVICES, "pagedserve.runtime", "pagedserve.shared", "pagedserve.bench", "redis"),
    "pagedserve.worker.core": (TOP, "torch", "redis", "transformers", "pagedserve.kernels", "pagedserve.runtime",
                               "pagedserve.worker.runner", "pagedserve.worker.serve", "pagedserve.worker.engine",
                               "pagedserve.worker.llm", "pagedserve.worker.model_source", "pagedserve.worker.demo_model",
                               "pagedserve.gateway", "pagedserve.bench"),
    "pagedserve.worker.runner": (TOP, "redis", "pagedserve.worker.serve", "pagedserve.worker.engine.",
                                 "pagedserve.worker.llm", "pagedserve.gateway", "pagedserve.bench"),
    "pagedserve.worker.engine": (TOP, "redis", "pagedserve.worker.serve", "pagedserve.worker.llm", "pagedserve.gateway",
                                 "pagedserve.bench"),
    "pagedserve.worker.llm": (TOP, "redis", "pagedserve.worker.serve", "pagedserve.gateway", "pagedserve.bench"),
    "pagedserve.worker": (TOP, "pagedserve.gateway", "pagedserve.bench"),
    "pagedserve.gateway": (TOP, "pagedserve.worker", "pagedserve.kernels", "pagedserve.bench", "torch"),
}
ENGINE_INSIDE = ("pagedserve.worker.core", "pagedserve.worker.engine")  # who may touch engine.scheduler


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    name = ".".join([FOLDERS[rel.parts[0]], *rel.with_suffix("").parts[1:]])
    return name.removesuffix(".__init__")


def source_modules() -> list[tuple[str, Path]]:
    return [(module_name(p), p) for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]


KNOWN = {name for name, _ in source_modules()}


def imported_names(path: Path, strings: bool = True) -> list[tuple[int, str]]:
    """Every name the module imports, statically or (``strings``) by a string naming one of ours."""
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append((node.lineno, node.module))
            names += [(node.lineno, f"{node.module}.{a.name}") for a in node.names if f"{node.module}.{a.name}" in KNOWN]
        elif strings and isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value and node.value in KNOWN:
            names.append((node.lineno, node.value))
    return names


def is_under(name: str, prefix: str) -> bool:
    if prefix == TOP:  # the top package itself or one of its own modules, not a mapped subpackage
        return name == TOP or (name.startswith(TOP + ".") and not any(is_under(name, s) for s in SUBPACKAGES))
    if prefix.endswith("."):  # a module's children only (the runner may use engine_config, not engine)
        return name.startswith(prefix)
    return name == prefix or name.startswith(prefix + ".")


def banned_for(module: str) -> tuple[str, ...]:
    return tuple(b for prefix, bans in BANNED.items() if is_under(module, prefix) for b in bans)


def violations(module: str, path: Path) -> list[str]:
    bans = banned_for(module)
    return [f"{module}:{line} imports {name}" for line, name in imported_names(path)
            if name != module and any(is_under(name, b) for b in bans)]


def test_no_module_imports_against_the_layers():
    assert [v for name, path in source_modules() for v in violations(name, path)] == []


def test_the_rule_table_catches_upward_imports(tmp_path):
    """The checker itself: a core module importing the runner, torch or (by a string) the CLI is reported."""
    module = tmp_path / "bad.py"
    module.write_text("import torch\nimport importlib\nfrom pagedserve.worker.runner.sampler import Sampler\n"
                      "from pagedserve.worker.core.plan import StepPlan\nimportlib.import_module('pagedserve.cli')\n")
    found = [v.split(" imports ")[1] for v in violations("pagedserve.worker.core.bad", module)]
    assert found == ["torch", "pagedserve.worker.runner.sampler", "pagedserve.cli"]
    gateway = tmp_path / "gw.py"
    gateway.write_text("from pagedserve import LLM\nfrom pagedserve.shared.keys import Keys\n")
    assert [v.split(" imports ")[1] for v in violations("pagedserve.gateway.gw", gateway)] == ["pagedserve"]


def test_shared_imports_only_msgpack_and_the_standard_library():
    outside = []
    for name, path in source_modules():
        if is_under(name, "pagedserve.shared"):
            for line, imported in imported_names(path):
                top = imported.split(".")[0]
                if top not in sys.stdlib_module_names and top != "msgpack" and not is_under(imported, "pagedserve.shared"):
                    outside.append(f"{name}:{line} imports {imported}")
    assert outside == []


def scheduler_reaches(path: Path) -> list[int]:
    """Lines where the module reads an attribute ``scheduler`` of anything (engine.scheduler...)."""
    tree = ast.parse(path.read_text(), str(path))
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "scheduler"]


def test_nothing_outside_the_engine_reaches_into_the_scheduler():
    reaches = [f"{name}:{line}" for name, path in source_modules()
               if not any(is_under(name, inside) for inside in ENGINE_INSIDE) for line in scheduler_reaches(path)]
    assert reaches == []


def test_the_attribute_check_catches_a_reach(tmp_path):
    module = tmp_path / "loop.py"
    module.write_text("def f(engine):\n    return engine.scheduler.blocks.usage()\n")
    assert scheduler_reaches(module) == [2]


@pytest.mark.parametrize("package, heavy", [
    ("pagedserve.worker.core", ("torch", "redis", "transformers", "numpy")),
    ("pagedserve.shared", ("torch", "transformers", "redis", "aiohttp", "llguidance", "numpy")),
])
def test_a_layer_loads_without_what_it_must_not_need(package, heavy):
    modules = sorted(name for name, _ in source_modules() if is_under(name, package))
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            f"print(','.join(sorted(m for m in {heavy!r} if m in sys.modules)))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""


def test_the_public_api_is_pagedserve():
    code = "import sys; from pagedserve import SamplingParams; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr


def import_graph() -> dict[str, set[str]]:
    """Our modules -> the modules of ours each imports, anywhere in it (inside functions too; a
    string naming a module may be a ``python -m`` command line, not an import, and is left out)."""
    graph = {}
    for name, path in source_modules():
        graph[name] = {imported for _, imported in imported_names(path, strings=False) if imported in KNOWN and imported != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_even_inside_functions():
    assert cycles(import_graph()) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the checker finds one
