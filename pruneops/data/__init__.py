"""Datasets: loaders (registry), prepared splits and the Great Expectations suite."""

from pruneops.data.splits import DataMeta, Split, load_meta, load_prepared, load_split

__all__ = ["DataMeta", "Split", "load_meta", "load_prepared", "load_split"]
