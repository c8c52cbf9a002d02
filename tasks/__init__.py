"""Prefect tasks: thin wrappers over the DVC stages and the pruneops library."""
