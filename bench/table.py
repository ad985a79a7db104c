"""The readable half of a benchmark's output: rows of dicts as an aligned table."""

from __future__ import annotations

from typing import Callable, Sequence

Column = tuple[str, Callable[[dict], object]]  # header, how to show a row's value


def print_table(rows: Sequence[dict], columns: Sequence[Column]) -> None:
    cells = [[str(show(row)) for _, show in columns] for row in rows]
    widths = [max([len(header)] + [len(line[i]) for line in cells]) for i, (header, _) in enumerate(columns)]
    print("  ".join(header.rjust(w) for (header, _), w in zip(columns, widths)))
    for line in cells:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)))
