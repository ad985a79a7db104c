"""The dashboard's picture of the block pool: values per block, run-length encoding, grouping
of large pools, the byte bound at a million blocks."""

from __future__ import annotations

import msgpack

from pagedserve.worker.core.kv_cache.block_manager import BlockManager
from pagedserve.worker.core.kv_cache.pool_map import BYTE_BUDGET, MAX_CELLS, MAX_VALUE, cell_values, decode, encode


def test_free_owned_shared_and_cached_blocks_each_have_their_value():
    blocks = BlockManager(8, block_size=4)
    blocks.start(1)
    blocks.grow(1, 8)  # two blocks, one table
    blocks.fork(1, 2)  # both shared by two tables
    blocks.start(3)
    blocks.grow(3, 4)
    blocks.register_full_blocks(3, [5, 6, 7, 8, 9], 4)
    blocks.free(3)  # its one full block stays in the prefix cache
    values = list(cell_values(blocks.gpu))
    assert values == [3, 3, 1, 0, 0, 0, 0, 0]
    assert decode(encode(values)) == (values, 1)


def test_a_block_shared_past_the_top_value_shows_the_top_value():
    blocks = BlockManager(4, block_size=4)
    blocks.start(0)
    blocks.grow(0, 4)
    for child in range(1, 300):
        blocks.fork(0, child)
    assert list(cell_values(blocks.gpu)) == [MAX_VALUE, 0, 0, 0]


def test_a_million_blocks_fit_the_byte_budget_whatever_their_states():
    worst = [2 + (i // 128) % 2 if i % 128 else 200 * ((i // 128) % 2) for i in range(1 << 20)]  # no two cells alike
    encoded = encode(worst)
    cells, group = decode(encoded)
    assert group == 128 and len(cells) == MAX_CELLS and len(encoded) == 2 + 2 * MAX_CELLS
    assert cells[:4] == [2, 200, 2, 200]  # a group shows its most shared block
    assert len(msgpack.packb(encoded)) <= BYTE_BUDGET
    mostly_free = [0] * (1 << 20)
    mostly_free[5000:5100] = [2] * 100
    cells, group = decode(encode(mostly_free))
    assert len(msgpack.packb(encode(mostly_free))) < 64 and cells[5000 // group] == 2
