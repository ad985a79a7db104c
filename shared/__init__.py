"""pagedserve shared package."""
