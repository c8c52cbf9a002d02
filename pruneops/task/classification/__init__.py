"""pruneops/task/classification."""
