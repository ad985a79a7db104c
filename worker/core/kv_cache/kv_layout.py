"""Which KV block table each layer reads, and which row of the pool holds it: layers grouped by
their attention, with no padding whatever the layer counts.

A model's layers each attend fully (window 0) or within a sliding window W. Layers of one kind
form a group; every group is cut into *lanes* of ``slots`` layers, ``slots`` being the greatest
common divisor of the groups' sizes, so every lane has exactly ``slots`` layers. A KV block is one
lane's worth of KV: ``slots`` layers x ``block_size`` positions; the pool's row ``s`` holds the
``s``-th layer of whichever lane the block was given to. A sequence has one block table per lane,
all from one pool: a full lane's table covers every position, a sliding lane's keeps only the
blocks its window can still see (older entries are released, ``NO_BLOCK``).

Gemma 3 270M (15 sliding layers of 512, 3 full): ``slots`` 3, lanes [full, sliding x 5]; an 8k
sequence holds 1 x 512 + 5 x ~33 blocks of 3 layers, not 512 blocks of 18. A model with one kind
of attention has one lane of all its layers: the layout of a model without groups.

Pure Python, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class KvLayout:
    lane_windows: tuple[int, ...]  # each lane's window (0: full attention), full lanes first
    slots: int  # layers per lane: the pool rows of one block
    layer_lanes: tuple[int, ...]  # each layer's lane
    layer_slots: tuple[int, ...]  # each layer's row of the pool

    @classmethod
    def of(cls, layer_windows: Sequence[int]) -> KvLayout:
        """The layout of layers with these windows (0: full attention), in layer order."""
        windows = [int(w) for w in layer_windows]
        if not windows or any(w < 0 for w in windows):
            raise ValueError(f"layer windows must be >= 0, one per layer, got {windows}")
        kinds = sorted(set(windows))  # full (0) first, then the windows from the narrowest
        counts = {kind: windows.count(kind) for kind in kinds}
        slots = math.gcd(*counts.values())
        first_lane, lane_windows = {}, []
        for kind in kinds:
            first_lane[kind] = len(lane_windows)
            lane_windows += [kind] * (counts[kind] // slots)
        seen = {kind: 0 for kind in kinds}
        lanes, rows = [], []
        for window in windows:
            index = seen[window]
            seen[window] += 1
            lanes.append(first_lane[window] + index // slots)
            rows.append(index % slots)
        return cls(tuple(lane_windows), slots, tuple(lanes), tuple(rows))

    @classmethod
    def uniform(cls, num_layers: int, window: int = 0) -> KvLayout:
        """Every layer alike: one lane of all of them."""
        return cls.of([window] * num_layers)

    @classmethod
    def single(cls, layer_windows: Sequence[int]) -> KvLayout:
        """One lane of every layer whatever their windows (the hybrid cache turned off): it slides
        only where every layer does, by the widest window."""
        windows = list(layer_windows)
        return cls.uniform(len(windows), max(windows) if windows and all(windows) else 0)

    @property
    def num_lanes(self) -> int:
        return len(self.lane_windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_lanes)

    @property
    def sliding(self) -> bool:
        """Whether any lane slides (its old blocks are released)."""
        return any(self.lane_windows)

    @property
    def hybrid(self) -> bool:
        """More than one lane: per-lane tables matter."""
        return self.num_lanes > 1

    def blocks_held(self, num_tokens: int, block_size: int, extra_tokens: int = 0) -> int:
        return blocks_held(self.lane_windows, num_tokens, block_size, extra_tokens)


def blocks_held(lane_windows: Sequence[int], num_tokens: int, block_size: int, extra_tokens: int = 0) -> int:
    """Blocks one sequence of ``num_tokens`` holds at most, every lane counted: a full lane all of
    them, a sliding lane its window, ``extra_tokens`` computed at once, and a partial block."""
    total = -(-num_tokens // block_size)
    return sum(total if not window else min(total, -(-(window + extra_tokens) // block_size) + 1)
               for window in lane_windows)
