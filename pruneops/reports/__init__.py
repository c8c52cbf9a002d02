"""pruneops/reports."""
