"""pruneops/training."""
