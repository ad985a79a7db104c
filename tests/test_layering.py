"""The layers import one way only (docs/architecture.md): serve -> engine -> runner -> core,
runner -> kernels, every service -> runtime -> shared; ``shared`` imports nothing but msgpack and
the standard library; only the top of ``pagedserve`` (cli, stack, ...) imports both services; each
subsystem folder keeps its own rules (the KV cache imports no scheduler) and no two folders import
each other, however indirectly. The folder -> package map is pyproject.toml's, read here, so a
folder renamed or emptied there fails here instead of leaving its rules applied to nothing.
Names count however they are spelled: an ``import``, an ``importlib.import_module`` string, or a
string naming a module (``pagedserve.cli``'s bench table). Outside the engine nothing reaches
into the scheduler: the serve layer and the benchmarks read ``Engine``'s methods."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
FOLDERS = {folder: package for package, folder in SETUPTOOLS["package-dir"].items()}  # folder -> package
TOP = "pagedserve"  # the package itself and its own modules (cli, stack, serve_args, embedded_redis)
SUBPACKAGES = tuple(v for v in FOLDERS.values() if v != TOP)
SERVICES = ("pagedserve.worker", "pagedserve.gateway")
W = "pagedserve.worker"
G = "pagedserve.gateway"

# A module whose dotted name starts with the key may not import a name that starts with a banned prefix.
BANNED = {
    "pagedserve.shared": (TOP, "pagedserve.runtime", *SERVICES, "pagedserve.kernels", "pagedserve.bench"),
    "pagedserve.runtime": (TOP, *SERVICES, "pagedserve.kernels", "pagedserve.bench", "torch"),
    "pagedserve.kernels": (TOP, *SERVICES, "pagedserve.runtime", "pagedserve.shared", "pagedserve.bench", "redis"),
    W: (TOP, G, "pagedserve.bench"),
    f"{W}.core": ("torch", "redis", "transformers", "pagedserve.kernels", "pagedserve.runtime", f"{W}.runner",
                  f"{W}.serve", f"{W}.engine", f"{W}.llm", f"{W}.source", f"{W}.setup"),
    f"{W}.core.kv_cache": (f"{W}.core.scheduling", f"{W}.core.speculative"),  # the KV cache knows no scheduler
    f"{W}.core.speculative": (f"{W}.core.scheduling", f"{W}.core.kv_cache"),
    f"{W}.source": ("redis", f"{W}.runner", f"{W}.serve", f"{W}.engine", f"{W}.llm", f"{W}.setup", f"{W}.core"),
    f"{W}.runner": (TOP, "redis", f"{W}.serve", f"{W}.engine", f"{W}.llm", f"{W}.setup"),
    f"{W}.setup": (TOP, "redis", f"{W}.serve", f"{W}.engine", f"{W}.llm"),
    f"{W}.engine": (TOP, "redis", f"{W}.serve", f"{W}.llm"),
    f"{W}.llm": (TOP, "redis", f"{W}.serve"),
    G: (TOP, W, "pagedserve.kernels", "pagedserve.bench", "torch"),
    f"{G}.http": (f"{G}.bodies", f"{G}.answers", f"{G}.routing", f"{G}.dashboard", f"{G}.service", f"{G}.routes", f"{G}.app"),
    f"{G}.routing": ("aiohttp", f"{G}.bodies", f"{G}.service", f"{G}.routes", f"{G}.app"),  # scores, no HTTP
    f"{G}.bodies": (f"{G}.service", f"{G}.routes", f"{G}.app"),
    f"{G}.answers": (f"{G}.service", f"{G}.routes", f"{G}.app"),
}
# who may touch engine.scheduler: the engine, its step loop, the scheduling core
ENGINE_INSIDE = ("pagedserve.worker.core", "pagedserve.worker.engine", "pagedserve.worker.step_loop")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    name = ".".join([FOLDERS[rel.parts[0]], *rel.with_suffix("").parts[1:]])
    return name.removesuffix(".__init__")


def source_modules() -> list[tuple[str, Path]]:
    return [(module_name(p), p) for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py"))]


KNOWN = {name for name, _ in source_modules()}


def test_every_mapped_folder_holds_modules_and_every_package_is_installed():
    """pyproject.toml's map names folders that exist and hold code, and lists every package in them
    (a package left out of ``packages`` is missing from the wheel)."""
    assert {"shared", "runtime", "paged_kernels", "worker", "gateway", "pagedserve"} <= set(FOLDERS)
    empty = [f for f in FOLDERS if not (ROOT / f).is_dir() or not any((ROOT / f).rglob("*.py"))]
    assert empty == []
    on_disk = {module_name(init) for folder in FOLDERS for init in (ROOT / folder).rglob("__init__.py")}
    assert sorted(on_disk ^ set(SETUPTOOLS["packages"])) == []
    folders_with_code = {module_name(p.parent / "__init__.py") for _, p in source_modules()}
    assert sorted(folders_with_code - on_disk) == []  # no module outside a package


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
    return name == prefix or name.startswith(prefix + ".")


def banned_for(module: str) -> tuple[str, ...]:
    return tuple(b for prefix, bans in BANNED.items() if is_under(module, prefix) for b in bans)


def violations(module: str, path: Path) -> list[str]:
    bans = banned_for(module)
    return [f"{module}:{line} imports {name}" for line, name in imported_names(path)
            if name != module and any(is_under(name, b) for b in bans)]


def test_no_module_imports_against_the_layers():
    assert [v for name, path in source_modules() for v in violations(name, path)] == []


def test_every_rule_names_a_real_package_or_module():
    """A rule about a folder that was renamed or moved would check nothing."""
    ours = [p for p in [*BANNED, *(b for bans in BANNED.values() for b in bans)] if p.startswith("pagedserve")]
    assert [p for p in ours if not any(is_under(k, p) for k in KNOWN)] == []


@pytest.mark.parametrize("module, planted, reported", [
    ("pagedserve.worker.core.scheduling.bad", "import torch", "torch"),
    ("pagedserve.worker.core.scheduling.bad", "from pagedserve.worker.runner.sampling.sampler import Sampler",
     "pagedserve.worker.runner.sampling.sampler"),
    ("pagedserve.worker.core.kv_cache.bad", "from pagedserve.worker.core.scheduling.plan import StepPlan",
     "pagedserve.worker.core.scheduling.plan"),
    ("pagedserve.worker.core.kv_cache.bad", "import importlib\nimportlib.import_module('pagedserve.cli')", "pagedserve.cli"),
    ("pagedserve.kernels.bad", "from pagedserve.worker.engine import Engine", "pagedserve.worker.engine"),
    ("pagedserve.shared.bad", "from pagedserve.runtime.env import Env", "pagedserve.runtime.env"),
    ("pagedserve.worker.source.bad", "def f():\n    from pagedserve.worker.runner.models.families import FAMILIES",
     "pagedserve.worker.runner.models.families"),
    ("pagedserve.worker.runner.bad", "from pagedserve.worker.setup.engine_config import EngineConfig",
     "pagedserve.worker.setup.engine_config"),
    ("pagedserve.gateway.routing.bad", "from aiohttp import web", "aiohttp"),
    ("pagedserve.gateway.gw", "from pagedserve import LLM", "pagedserve"),
])
def test_each_rule_catches_a_planted_import(tmp_path, module, planted, reported):
    path = tmp_path / "planted.py"
    path.write_text(f"{planted}\nimport json\n")
    assert [v.split(" imports ")[1] for v in violations(module, path)] == [reported]


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


def folder_of(module: str) -> str:
    """The package whose folder holds the module (a package's ``__init__`` is in its own folder)."""
    is_package = any(k.startswith(module + ".") for k in KNOWN)
    return module if is_package else module.rpartition(".")[0]


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Folders -> the folders their modules import. A ``__main__`` is an entry point that nothing
    imports, so it joins no loop and is left out."""
    folders: dict[str, set[str]] = {}
    for module, imported in graph.items():
        if module.endswith(".__main__"):
            continue
        here = folder_of(module)
        folders.setdefault(here, set()).update(f for f in map(folder_of, imported) if f != here)
    return folders


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one node (Tarjan)."""
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


def test_no_two_folders_import_each_other():
    """Folder by folder (each folder its own modules, a parent's apart from its children's), imports
    run one way: no loop like runner -> lora -> runner's models, even through a function's import."""
    assert cycles(folder_graph(import_graph())) == []


def test_the_folder_check_catches_a_loop():
    planted = {"pagedserve.worker.runner.models.layers": {"pagedserve.worker.runner.lora.adapters"},
               "pagedserve.worker.runner.lora.adapters": {"pagedserve.worker.runner.models.layers"},
               "pagedserve.worker.__main__": {"pagedserve.worker.serve.service"},
               "pagedserve.worker.serve.service": {"pagedserve.worker.engine"}}
    assert cycles(folder_graph(planted)) == [["pagedserve.worker.runner.lora", "pagedserve.worker.runner.models"]]
