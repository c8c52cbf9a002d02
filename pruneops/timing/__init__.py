"""Timing on the serving machine.

Machine identity, interleaved ONNX Runtime sessions, and the per-layer latency table.
"""
