"""How well the latency model predicts allocations it never saw, on this machine.

python studies/timing/latency_prediction_check.py MODEL [--width 32] [--allocations 12] [--seed 2]

MODEL is a registered name or `package.module:factory` (e.g.
`tests.models.families:mobilenet_v2_style`), built untrained for 1×28×28 inputs and 10 classes
(latency does not depend on the weights). The latency model is built as the sensitivity stage
builds it (1 thread, batches 1 and 64); then random allocations (each unit at one of its fast
widths, at least 15 % of it kept) are exported and timed interleaved with dense, and each
prediction (anchored on dense measured in the same run, as the prune stage does) is compared
with its measurement. Every predictor (per-layer MAC costs, per-layer table costs, one line over
the table sum) is refitted on the same exports and scored on the same allocations; the one the
build chose is marked.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch


def main() -> int:
    """Builds, measures and prints the errors per batch size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--allocations", type=int, default=12)
    parser.add_argument("--seed", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

    from pruneops.config import BenchmarkConfig
    from pruneops.models import ModelSpec, create_model
    from pruneops.pruning.importance import IMPORTANCES
    from pruneops.pruning.units import UnitPruner
    from pruneops.task.classification import latency as lat

    torch.set_num_threads(1)
    shape = [1, 28, 28]
    kwargs = {"width": args.width} if ":" in args.model else {}
    model = create_model(ModelSpec(args.model, shape, 10, kwargs)).eval()
    example = torch.zeros(1, *shape)
    units = [(n, u.size) for n, u in UnitPruner(model, example, IMPORTANCES.get("l2")).units().items()]
    started = time.perf_counter()
    latency = lat.build_latency_model(
        model, example, shape, units, lat.LatencyTable(lat.machine_fingerprint(1)), [1, 64]
    )
    print(f"latency model built in {time.perf_counter() - started:.0f} s ({len(units)} units)")
    rng = random.Random(args.seed)
    widths = {"dense": {}}
    for i in range(args.allocations):
        widths[f"a{i}"] = {
            n: rng.choice([w for w in latency.efficient_widths(n, 1) if w >= 0.15 * s]) for n, s in units
        }
    models = {k: lat.pruned_or_none(model, example, w) for k, w in widths.items()}
    models = {k: m for k, m in models.items() if m is not None}
    timing = BenchmarkConfig(threads=1, batch_sizes=[1, 64], warmup=5, repeats=20, rounds=3)
    measured = lat.measured_latency(models, shape, timing)
    chosen = {b: latency.layer_costs[b][0] if b in latency.layer_costs else "line" for b in (1, 64)}
    for batch in (1, 64):
        summary = []
        for predictor in lat.PREDICTORS:  # each refitted on the same exports, for comparison
            latency.fit_(predictor, batch)
            errors = []
            for key in models:
                if key == "dense":
                    continue
                dense_ms, ms = measured["dense"][batch], measured[key][batch]
                predicted = latency.predict(widths[key], batch) / latency.predict({}, batch) * dense_ms
                errors.append(predicted / ms - 1)
                if predictor == chosen[batch]:
                    print(f"batch {batch} {key}: measured {ms / dense_ms:.2f} of dense, error {errors[-1]:+.1%}")
            mark = " (chosen)" if predictor == chosen[batch] else ""
            summary.append(
                f"{predictor}{mark}: median {np.median(np.abs(errors)):.1%}, max {np.max(np.abs(errors)):.1%}"
            )
        print(f"batch {batch} |error| " + "; ".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
