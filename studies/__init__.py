"""One-off measurements, each a script and its result (not installed, not in the guide)."""
