"""pruneops/task."""
