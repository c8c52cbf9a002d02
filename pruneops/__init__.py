"""PruneOps: prune PyTorch models so they serve faster, inside a reproducible pipeline.

`pruneops.prune(model, recipe, train=..., val=...)` prunes a model to a recipe (the `prune` section
of `params.yaml`) and fine-tunes it between steps, what the pipeline's prune stage runs
(`pruneops.planning.recipe`). It is imported on first use: `import pruneops` stays light for the
torch-free serving image.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["prune"]


def __getattr__(name: str) -> Any:
    if name == "prune":
        # By name, not an import statement: every stage imports this package, and a stage's DVC deps
        # are its import closure, so a static import here would make `train` depend on the pruning
        # code. The prune stage imports pruneops.planning.recipe itself.
        return importlib.import_module("pruneops.planning.recipe").prune
    raise AttributeError(f"module 'pruneops' has no attribute {name!r}")
