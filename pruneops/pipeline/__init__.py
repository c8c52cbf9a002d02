"""pruneops/pipeline."""
