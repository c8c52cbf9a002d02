"""The batch-1 floor of the `benchmarks/mnist-wide.yaml` CNN on this machine.

Usage: `python scripts/measure_cnn_floor.py` (no arguments; nothing downloaded).
Builds the workload's `cnn` (widths [64, 128], 1 block; random weights: latency does not depend on
their values), and the same graph with every prunable unit at 8 channels and at the narrowest that
`prune.max_unit_ratio: 0.94` allows, and times the three interleaved in one process (ONNX Runtime,
1 thread, batch 1 and 64), in fp32 and in static INT8 as the quantize stage would make it. Prints
median ms and the speed-up over dense fp32: how far pruning *this graph* can go here at all.
"""

import torch

from pruneops.config import BenchmarkConfig
from pruneops.models.registry import ModelSpec, create_model
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.units import UnitPruner
from pruneops.timing.sessions import measured_latency

SHAPE = [1, 28, 28]
SPEC = ModelSpec("cnn", SHAPE, 10, {"widths": [64, 128], "blocks": 1})
NARROWEST = {"every unit 8": lambda size: min(size, 8), "every unit at 0.94": lambda size: max(1, round(0.06 * size))}


def main() -> None:
    """Prints each model's median ms per form and batch size, and its batch-1 speed-up over dense fp32."""
    dense = create_model(SPEC).eval()
    x = torch.zeros(1, *SHAPE)
    sizes = {n: u.size for n, u in UnitPruner(dense, x, IMPORTANCES.get("l2")).units().items()}
    print("prunable units:", sizes)
    models = {"dense": dense}
    for label, width in NARROWEST.items():
        narrow = create_model(SPEC).eval()
        narrow.load_state_dict(dense.state_dict())
        UnitPruner(narrow, x, IMPORTANCES.get("l2")).prune_to_({n: width(s) for n, s in sizes.items()})
        models[label] = narrow.eval()
    timing = BenchmarkConfig(threads=1, batch_sizes=[1, 64], warmup=20, repeats=100, rounds=5)
    dense_fp32 = None
    for form in ("fp32", "static"):
        ms = measured_latency(models, SHAPE, timing, form=form)
        dense_fp32 = dense_fp32 or ms["dense"][1]
        for name, per in ms.items():
            print(
                f"{form:6s} {name:20s} b1 {per[1]:.4f} ms ({dense_fp32 / per[1]:.1f}x dense fp32)  b64 {per[64]:.3f} ms"
            )


if __name__ == "__main__":
    main()
