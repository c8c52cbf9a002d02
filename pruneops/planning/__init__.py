"""How much to cut where.

The latency model and its predictors, allocation, targets, the gate, the closed latency loop and
plan trials.
"""
