"""docs/architecture.md names files, and each of them exists: the map a newcomer reads matches the tree."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(r"`((?:pagedserve|shared|runtime|worker|gateway|kernels|bench|tests|docs)/[\w/]+\.(?:py|md|c|sh))`")


def test_every_file_the_architecture_names_exists():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(PATH.findall(text))
    assert len(named) > 30  # the table of where things live
    assert sorted(p for p in named if not (ROOT / p).exists()) == []



def test_the_layer_map_names_real_folders_and_files():
    """The code block at the top: each line's folder, and each ``name.py`` it spells out."""
    block = (ROOT / "docs" / "architecture.md").read_text().split("```")[1]
    folders = [m for m in re.findall(r"^(\S+/)", block, re.M)]
    files = re.findall(r"((?:worker/)?[a-z_]+\.py)", block)
    assert len(folders) >= 8 and files
    assert [f for f in folders if not (ROOT / f).is_dir()] == []
    assert [f for f in files if not (ROOT / f).exists() and not any(ROOT.glob(f"*/{f}"))] == []


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
    for folder in ("pagedserve", "shared", "runtime", "worker", "gateway", "kernels", "bench", "tests"):
        for source in (ROOT / folder).rglob("*.py"):
            for path in re.findall(r"``((?:pagedserve|shared|runtime|worker|gateway|kernels|bench|tests)/[\w/]+\.py)``",
                                   source.read_text()):
                if not (ROOT / path).exists():
                    missing.append(f"{source.relative_to(ROOT)}: {path}")
    assert missing == []
