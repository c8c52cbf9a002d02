"""pruneops/core."""
