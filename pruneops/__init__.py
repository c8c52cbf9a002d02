"""PruneOps: prune PyTorch models so they serve faster, inside a reproducible pipeline."""

__version__ = "0.1.0"
