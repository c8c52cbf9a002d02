"""pruneops/runtimes/onnxruntime."""
