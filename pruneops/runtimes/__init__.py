"""pruneops/runtimes."""
