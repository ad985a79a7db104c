"""How a decode launch cuts its contexts (``paged_kernels/decode_partitions.py``), plain arithmetic:
slices of 512 tokens where the batch fills the device, finer for a few long sequences until the
launch has ``FILL_PROGRAMS`` programs (down to 128 tokens, at most ``MAX_SPLITS`` slices), and the
partials' bytes memory planning reserves covering the largest launch of any batch size."""

from __future__ import annotations

from pagedserve.kernels.decode_partitions import (FILL_PROGRAMS, MAX_SPLITS, decode_partition, decode_scratch_bytes,
                                                  decode_splits)


def test_many_sequences_take_slices_of_512_and_a_few_long_ones_finer_slices():
    assert decode_partition(128, 8, 16384) == 512  # 128 x 8 heads x 32 slices: the device is full
    assert decode_partition(1, 8, 32768) == 256  # 8 heads x 64 slices = 512 programs: cut to 1,024
    assert decode_partition(1, 8, 8192) == 128  # 8 x 16 = 128 programs: as fine as it goes (512 at 128)
    assert decode_partition(4, 8, 8192) == 256 and decode_partition(8, 8, 8192) == 512  # 8 x 8 x 16 = 1,024
    assert decode_partition(1, 1, 100) == 128  # a short context: one slice whatever the cut


def test_the_cut_stops_at_the_slice_limit():
    assert decode_partition(1, 1, 131072) == 512  # 256 slices: finer would be 512 of them
    assert decode_partition(1, 1, 65536) == 256 and decode_splits(65536, 256) == MAX_SPLITS
    assert decode_partition(1, 1, 32768) == 128 and decode_splits(32768, 128) == MAX_SPLITS


def test_the_programs_reach_the_fill_where_the_slices_allow():
    for seqs, heads, length in [(1, 8, 32768), (2, 4, 20000), (3, 2, 40000), (1, 32, 4096)]:
        partition = decode_partition(seqs, heads, length)
        programs = seqs * heads * decode_splits(length, partition)
        assert programs >= FILL_PROGRAMS or partition == 128 or decode_splits(length, partition // 2) > MAX_SPLITS
        if partition < 512:  # cut no finer than it needed
            assert seqs * heads * decode_splits(length, partition * 2) < FILL_PROGRAMS


def test_slices_are_counted_whole():
    assert [decode_splits(n, 128) for n in (1, 128, 129, 256)] == [1, 1, 2, 2]
    assert decode_splits(0) == 1 and decode_splits(513) == 2  # 512 by default


def test_the_scratch_covers_a_smaller_batch_cut_finer():
    row = 32 * 130 * 4  # 32 query heads of 128 floats, a maximum and a sum
    assert decode_scratch_bytes(256, 32, 128, 131072) == 256 * 256 * row  # the largest batch, in slices of 512
    # at 8k: 256 sequences x 16 slices = 4,096 rows; one sequence cut to 128 is 64 rows, 15 cut to 256 is
    # 15 x 32 = 480; the largest batch holds the most
    assert decode_scratch_bytes(256, 32, 128, 8192) == 256 * 16 * row
    # at 4 sequences of 32k the batch of 4 is cut to 128 (4 x 256 rows): more than its slices of 512
    assert decode_scratch_bytes(4, 32, 128, 32768) == max(n * decode_splits(32768, decode_partition(n, 1, 32768))
                                                          for n in range(1, 5)) * row == 4 * 256 * row
    assert decode_scratch_bytes(0, 32, 128, 4096) == 0
