"""Memory for what the CPU kernels stream (``paged_kernels/host_memory.py``), and a GGUF's blocks
kept in it where Linux offers huge pages, mapped from the file where it does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.kernels.host_memory import huge_page_copy, huge_page_empty, huge_pages_offered


@pytest.mark.parametrize("setting, offered", [("always [madvise] never\n", True), ("[always] madvise never\n", True),
                                              ("always madvise [never]\n", False), (None, False)])
def test_huge_pages_are_offered_unless_the_setting_says_never_or_cannot_be_read(tmp_path, setting, offered):
    path = tmp_path / "enabled"
    if setting is not None:
        path.write_text(setting)
    assert huge_pages_offered(path) is offered


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.uint8])
def test_a_copy_in_numpy_s_memory_is_the_tensor_contiguous_and_writable(dtype):
    source = (torch.randn(6, 70) * 50).to(dtype).view(6, 35, 2).transpose(1, 2)  # not contiguous
    copy = huge_page_copy(source)
    assert copy.dtype == dtype and copy.shape == source.shape and copy.is_contiguous()
    assert torch.equal(copy, source)
    copy.zero_()  # its own memory: the source is untouched
    assert not torch.equal(copy, source)
    empty = huge_page_empty((3, 0, 4), dtype)
    assert empty.shape == (3, 0, 4) and empty.dtype == dtype


@pytest.mark.parametrize("huge_pages", [True, False])
def test_a_gguf_s_blocks_are_the_file_s_bytes_copied_or_mapped(zoo, tmp_path, huge_pages):
    """Copied into numpy's memory where huge pages are offered, the file's pages mapped (privately:
    a write never reaches the file) where not; either way the bytes the file stores, rows the
    converter permuted put back."""
    from gguf import GGUFReader

    from pagedserve.worker.source import gguf_weights
    from pagedserve.worker.source.gguf_file import open_gguf
    from tests.gguf_writer import write_gguf

    path = write_gguf(zoo.path("llama-gqa"), tmp_path / "q8.gguf", quantize="Q8_0")
    stored = {t.name: np.array(t.data) for t in GGUFReader(path).tensors}
    before = path.read_bytes()
    loads = dict(gguf_weights.gguf_tensors(open_gguf(path)))
    down = loads["model.layers.0.mlp.down_proj.weight"]  # stored as the file lays it out
    blocks = down.blocks(huge_pages=huge_pages)
    assert blocks.dtype == torch.uint8 and blocks.is_contiguous()
    assert torch.equal(blocks, torch.from_numpy(stored["blk.0.ffn_down.weight"]))
    query = loads["model.layers.0.self_attn.q_proj.weight"]  # rows permuted by the converter: put back
    assert torch.equal(query.blocks(huge_pages=huge_pages), torch.from_numpy(np.ascontiguousarray(
        query.fix(stored["blk.0.attn_q.weight"]))))
    blocks.fill_(7)
    assert path.read_bytes() == before
