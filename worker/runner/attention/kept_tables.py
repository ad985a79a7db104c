"""Every sequence's block tables as the runner keeps them between steps: a row per sequence of a host
tensor per lane, written in place. A step's row carries only the entries that changed since its
sequence's previous row (``ScheduledSeq.table_from``, ``BlockManager.table_change``); a batch's tables
and slots are gathered from the kept rows, so a step costs no Python work per table entry however
long the contexts (vLLM V1's persistent batch is the anchor).

Entries past a row's length are whatever an earlier table left there: no kernel reads past a
sequence's length, and every value is a block id or the released-block marker, as in a table.
"""

from __future__ import annotations

from typing import Iterable

import torch

from pagedserve.worker.core.scheduling.plan import ScheduledSeq


class KeptTables:
    def __init__(self, num_lanes: int, rows: int = 8, width: int = 64) -> None:
        self.num_lanes = num_lanes
        self._tables = torch.zeros((num_lanes, rows, width), dtype=torch.int32, device="cpu")  # [lane, row, entry]
        self._lens = [0] * rows  # each row's table length
        self._free = list(reversed(range(rows)))
        self._rows: dict[int, int] = {}  # seq id -> its row
        self._seqs: dict[str, set[int]] = {}  # request id -> its seq ids that hold a row
        self._owner: dict[int, str] = {}  # seq id -> its request id

    @classmethod
    def of(cls, rows: Iterable[ScheduledSeq], num_lanes: int = 1) -> KeptTables:
        """Tables kept for nothing but these rows (each carrying its whole tables)."""
        kept = cls(num_lanes)
        kept.update(rows)
        return kept

    def update(self, rows: Iterable[ScheduledSeq]) -> None:
        """Take each row's changed entries (``ScheduledSeq.check_kept``: a ValueError where a step's
        changes were lost)."""
        for s in rows:
            row = self._row(s.seq_id, s.request_id)
            s.check_kept(self._lens[row])
            end = s.table_from + len(s.block_table)
            if end > s.table_from:
                self._fit(end)
                tails = [s.table(lane) for lane in range(self.num_lanes)]
                self._tables[:, row, s.table_from : end] = torch.tensor(tails, dtype=torch.int32, device="cpu")
            self._lens[row] = end

    def forget(self, request_ids: Iterable[str], seq_ids: Iterable[int] = ()) -> None:
        """Free the rows of these (ended) requests' sequences, and of these (dropped) sequences."""
        for request_id in request_ids:
            for seq_id in self._seqs.pop(request_id, ()):
                del self._owner[seq_id]
                self._free.append(self._rows.pop(seq_id))
        for seq_id in seq_ids:
            if seq_id in self._rows:
                self._seqs[self._owner.pop(seq_id)].discard(seq_id)
                self._free.append(self._rows.pop(seq_id))

    def __len__(self) -> int:
        """Sequences that hold a row."""
        return len(self._rows)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._rows

    def length(self, seq_id: int) -> int:
        return self._lens[self._rows[seq_id]]

    def tables(self, seq_ids: list[int], device: torch.device) -> torch.Tensor:
        """int32 ``[lanes, len(seq_ids), longest]``: every lane's tables of these sequences, in order
        (one gather for all lanes)."""
        rows = [self._rows[s] for s in seq_ids]
        width = max((self._lens[r] for r in rows), default=0)
        picked = self._tables[:, :, :width].index_select(1, torch.tensor(rows, dtype=torch.int64, device="cpu"))
        return picked.to(device, non_blocking=True)

    def slots(self, seq_ids: list[int], positions: list[int], block_size: int, device: torch.device) -> torch.Tensor:
        """int64 ``[lanes, len(positions)]``: each lane's slot of position ``positions[i]`` of
        sequence ``seq_ids[i]``."""
        rows = torch.tensor([self._rows[s] for s in seq_ids], dtype=torch.int64, device="cpu")
        at = torch.tensor(positions, dtype=torch.int64, device="cpu")
        blocks = self._tables[:, rows, at // block_size].to(torch.int64)
        return (blocks * block_size + at % block_size).to(device, non_blocking=True)

    def _row(self, seq_id: int, request_id: str) -> int:
        row = self._rows.get(seq_id)
        if row is None:
            if not self._free:
                self._grow(rows=2 * len(self._lens))
            row = self._rows[seq_id] = self._free.pop()
            self._lens[row] = 0
        owner = self._owner.get(seq_id)
        if owner != request_id:  # a seq id another request held (a calibration's, say) moves
            if owner is not None:
                self._seqs[owner].discard(seq_id)
            self._owner[seq_id] = request_id
            self._seqs.setdefault(request_id, set()).add(seq_id)
        return row

    def _fit(self, end: int) -> None:
        if end > self._tables.shape[2]:
            self._grow(width=max(end, 2 * self._tables.shape[2]))

    def _grow(self, rows: int | None = None, width: int | None = None) -> None:
        lanes, old_rows, old_width = self._tables.shape
        rows, width = rows or old_rows, width or old_width
        grown = torch.zeros((lanes, rows, width), dtype=torch.int32, device="cpu")
        grown[:, :old_rows, :old_width] = self._tables
        self._tables = grown
        self._lens += [0] * (rows - old_rows)
        self._free.extend(reversed(range(old_rows, rows)))
