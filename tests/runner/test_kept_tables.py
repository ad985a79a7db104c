"""The runner's kept tables (worker/runner/attention/kept_tables.py): rows that carry only what changed
rebuild the whole tables, and a batch's slots and tables equal those of rows carrying whole tables."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve.worker.core.scheduling.plan import ScheduledSeq
from pagedserve.worker.runner.attention.kept_tables import KeptTables
from pagedserve.worker.runner.attention.step_inputs import step_inputs

CPU = torch.device("cpu")
BS = 4


def row(seq_id: int, tables: list[list[int]], start: int, count: int, table_from: int = 0) -> ScheduledSeq:
    first, *lanes = (tuple(t[table_from:]) for t in tables)
    return ScheduledSeq(seq_id, f"r{seq_id % 5}", (7,) * count, start, first, 1, lane_tables=tuple(lanes),
                        table_from=table_from)


def test_changed_entries_rebuild_the_tables_a_whole_row_gives():
    """Sequences grow, rewind and get a copy-on-write block at random over 300 steps; each step's rows
    carry only the entries from the first changed one, and the batch equals the one of whole rows."""
    rng = random.Random(5)
    lanes, kept = 3, KeptTables(3)
    tables = {s: [[] for _ in range(lanes)] for s in range(20)}  # more rows and wider than it starts with
    length = dict.fromkeys(tables, 0)
    sent = dict.fromkeys(tables, 0)  # entries the keeper holds as they are
    for _ in range(300):
        rows, whole = [], []
        for seq in rng.sample(sorted(tables), 6):
            grow = rng.choice([1, 1, 1, 9, 40])
            length[seq] += grow
            changed = len(tables[seq][0])
            if rng.random() < 0.2 and changed:  # copy-on-write of the last block
                changed -= 1
                for t in tables[seq]:
                    t[-1] = rng.randint(0, 999)
            if rng.random() < 0.1:  # a rewind: fewer blocks
                length[seq] = max(1, length[seq] - 30)
                for t in tables[seq]:
                    del t[-(-length[seq] // BS):]
                changed = min(changed, len(tables[seq][0]))
            for t in tables[seq]:
                t.extend(rng.randint(0, 999) for _ in range(-(-length[seq] // BS) - len(t)))
            start = length[seq] - rng.choice([1, min(grow, length[seq])])
            rows.append(row(seq, tables[seq], start, length[seq] - start, min(sent[seq], changed)))
            whole.append(row(seq, tables[seq], start, length[seq] - start))
            sent[seq] = len(tables[seq][0])
        kept.update(rows)
        got = step_inputs(rows, BS, CPU, False, lanes, kept).meta
        want = step_inputs(whole, BS, CPU, False, lanes).meta
        for lane in range(lanes):
            a, b = got.lane(lane), want.lane(lane)
            assert a.slot_mapping.tolist() == b.slot_mapping.tolist()
            for part in ("decode", "prefill"):
                tables_a, tables_b = getattr(a, f"{part}_block_tables"), getattr(b, f"{part}_block_tables")
                for x, y, s in zip(tables_a.tolist(), tables_b.tolist(), getattr(a, f"{part}_seq_lens").tolist()):
                    n = -(-s // BS)  # entries past a row's length are never read
                    assert x[:n] == y[:n]


def test_a_row_past_what_is_kept_is_refused_and_ended_requests_free_their_rows():
    kept = KeptTables(1)
    with pytest.raises(ValueError, match="seq 3: its row goes on from table entry 2, but only 0 are kept"):
        kept.update([row(3, [[5, 6, 7]], 10, 1, table_from=2)])
    kept.update([row(1, [[5, 6, 7]], 10, 1)])
    assert kept.length(1) == 3
    kept.update([row(1, [[5, 6, 7, 8]], 12, 1, table_from=3)])
    assert kept.tables([1], CPU)[0].tolist() == [[5, 6, 7, 8]]
    kept.forget(["r1"])
    with pytest.raises(KeyError):
        kept.length(1)
    kept.update([row(1, [[9]], 0, 1)])  # the id again, a new sequence: its whole table
    assert kept.tables([1], CPU)[0].tolist() == [[9]]
