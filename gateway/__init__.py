"""pagedserve gateway package."""
