"""pagedserve kernels package."""
