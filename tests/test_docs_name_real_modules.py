"""docs/architecture.md names files, each of them exists, and its layer map names every product
file in its own folder's entry: the map a newcomer reads matches the tree, whole."""

import re
from pathlib import Path

from tests.test_layering import FOLDERS

ROOT = Path(__file__).resolve().parents[1]
TOPS = "|".join(FOLDERS)  # the folders pyproject.toml maps, one copy
PATH = re.compile(rf"`((?:{TOPS}|tests|docs)/[\w/]+\.(?:py|md|c|sh))`")


def test_every_file_the_architecture_names_exists():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(PATH.findall(text))
    assert len(named) > 30  # the table of where things live
    assert sorted(p for p in named if not (ROOT / p).exists()) == []



def layer_map() -> dict[str, str]:
    """The code block at the top: each folder's entry (its line and the indented lines under it)."""
    block = (ROOT / "docs" / "architecture.md").read_text().split("```")[1]
    return {m[0]: m[1] for m in re.findall(r"^(\S+/)(.*(?:\n[ \t]+.*)*)", block, re.M)}


def unnamed(entries: dict[str, str], root: Path) -> list[str]:
    """Product files whose folder has no entry, or whose name is not a word of their folder's entry."""
    missing = []
    for top in FOLDERS:
        for path in sorted((root / top).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            folder = path.parent.relative_to(root).as_posix() + "/"
            if not re.search(rf"(?<![\w/.]){path.stem}(?![\w/'-])", entries.get(folder, "")):
                missing.append(path.relative_to(root).as_posix())
    return missing


def test_the_layer_map_names_every_product_file_in_its_folder():
    entries = layer_map()
    assert len(entries) >= 20
    assert [f for f in entries if not (ROOT / f).is_dir()] == []
    assert unnamed(entries, ROOT) == []


def test_the_map_check_catches_a_file_left_out(tmp_path):
    for name in ("worker/core/scheduling/scheduler.py", "worker/core/scheduling/plan.py", "shared/keys.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    entries = {"worker/core/scheduling/": " scheduler (writes plans: a plan's rows, plan-like)", "shared/": " keys"}
    assert unnamed(entries, tmp_path) == ["worker/core/scheduling/plan.py"]


def test_names_given_with_a_file_are_in_it():
    """```path.py` (`Name`, ... `Other`)``: each function, class or constant the table points to in a
    file's parenthesis is in that file."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    pairs = [(path, name) for path, inside in re.findall(r"`([\w/]+\.py)` \(([^)]*)\)", text)
             for name in re.findall(r"`(\w+)`", inside)]
    assert len(pairs) >= 10
    assert [f"{path}: {name}" for path, name in pairs if name not in (ROOT / path).read_text()] == []


def test_the_files_docstrings_and_comments_name_exist():
    """A module's ``folder/file.py`` pointers (docstrings, comments) lead somewhere real."""
    missing = []
    for folder in (*FOLDERS, "tests"):
        for source in (ROOT / folder).rglob("*.py"):
            for path in re.findall(rf"``((?:{TOPS}|tests)/[\w/]+\.py)``",
                                   source.read_text()):
                if not (ROOT / path).exists():
                    missing.append(f"{source.relative_to(ROOT)}: {path}")
    assert missing == []
