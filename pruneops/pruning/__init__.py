"""Pruning: methods, importance criteria, schedules, allocation and accounting."""

from pruneops.pruning.allocation import allocate_ratios
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.methods import METHODS, PruneContext, PruningMethod
from pruneops.pruning.report import layer_shapes, sparsity_report
from pruneops.pruning.schedule import SCHEDULES
from pruneops.pruning.units import UnitPruner, round_keep

__all__ = [
    "IMPORTANCES",
    "METHODS",
    "SCHEDULES",
    "PruneContext",
    "PruningMethod",
    "UnitPruner",
    "allocate_ratios",
    "layer_shapes",
    "round_keep",
    "sparsity_report",
]
