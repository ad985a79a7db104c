"""The accelerator: failures that end a worker, CUDA graphs for decode steps, and the memory one
step needs."""
