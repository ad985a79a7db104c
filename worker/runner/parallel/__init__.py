"""Tensor parallelism inside the model (``--tensor-parallel-size``): the ranks' process group, which slice
of each tensor a rank holds, and a rank's model wired to the group. The processes themselves (rank 0
starting the others, each follower) build a runner, so they live above it: ``worker/setup/ranks.py``."""
