"""Tensor parallelism (``--tensor-parallel-size``): one process per rank on torch.distributed."""
