"""Writes copies of a checkpoint with one unit pruned to each of several widths, and times them on this CPU.

For comparing which channel counts are fast on two machines: the copies go to
`OUT/FAMILY--wNNN/model.safetensors` (the width of the unit; the unpruned size is `FAMILY--dense`),
the layout `scripts/measure_gpu.py --checkpoints OUT` times on a GPU; `--time-cpu` times the same
copies here with ONNX Runtime (fp32, interleaved, batch 1 and 64) as the latency stage would, and
writes `OUT/cpu.json`.

Usage:
    python scripts/width_variants.py --checkpoint artifacts/train/model.safetensors --unit stages.0.conv1 \
        --widths 8,12,14,15,16,24,32,48 --family digits-stage0 --out .gpu/ckpt-widths [--time-cpu --threads 1]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pruneops.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from pruneops.config import BenchmarkConfig  # noqa: E402
from pruneops.inputs import timing_inputs  # noqa: E402
from pruneops.pruning.importance import IMPORTANCES  # noqa: E402
from pruneops.pruning.units import UnitPruner  # noqa: E402
from pruneops.timing.machine import machine_info  # noqa: E402
from pruneops.timing.sessions import measured_latency  # noqa: E402


def main() -> int:
    """Writes the width variants (and their CPU timings)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--unit", required=True)
    parser.add_argument("--widths", required=True, help="comma-separated channel counts")
    parser.add_argument("--family", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--time-cpu", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    ckpt = load_checkpoint(args.checkpoint)
    shape = list(ckpt.spec.input_shape)
    example = torch.from_numpy(timing_inputs(ckpt.model, shape, 2))
    models = {"dense": ckpt.model}
    for width in sorted(int(w) for w in args.widths.split(",")):
        twin = copy.deepcopy(ckpt.model)
        UnitPruner(twin, example, IMPORTANCES.get("l2")).prune_to_({args.unit: width})
        models[f"w{width:03d}"] = twin.eval()
    for name, model in models.items():
        save_checkpoint(args.out / f"{args.family}--{name}" / "model.safetensors", model, ckpt.spec)
    print(f"wrote {len(models)} checkpoints under {args.out}")
    if args.time_cpu:
        timing = BenchmarkConfig(threads=args.threads, batch_sizes=[1, 64], warmup=20, repeats=100, rounds=5)
        with torch.no_grad():
            ms = measured_latency(models, shape, timing)
        report = {**machine_info(args.threads), "ms": ms}
        (args.out / "cpu.json").write_text(json.dumps(report, indent=1))
        for name, per in ms.items():
            print(f"{name}: b1 {per[1]:.4f} ms, b64 {per[64]:.4f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
