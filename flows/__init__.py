"""Prefect flows: the pipeline, the gated re-prune and the drift check."""
