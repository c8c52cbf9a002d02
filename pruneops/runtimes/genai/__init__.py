"""pruneops/runtimes/genai."""
