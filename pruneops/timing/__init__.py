"""Timing that holds for every runtime: the machine's identity and features."""
