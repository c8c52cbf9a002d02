"""`pruneops bench`: workloads, their variants as DVC experiments, and one report per workload."""
