"""Fine-tunes several width plans of one trained model with the same recipe and compares them.

Asks whether the allocator's ranking (the summed isolated drop of the sensitivity sweep) agrees
with what fine-tuning recovers, and how the accuracy of the whole plan after BatchNorm
recalibration alone (EagleEye's adaptive-BN evaluation, no training) ranks the same plans. For
each plan and seed: the model pruned at once to the widths (L2), BatchNorm recalibrated on 1,024
training images, validation accuracy then, fine-tuned (`--epochs`, `--lr`, no distillation), and
validation and test accuracy after; then each plan's test change against the first plan with a
paired-bootstrap 95 % interval on the same test images.

Usage (a pipeline project with `artifacts/validate` and `artifacts/train`, e.g. a bench variant
restored with `dvc exp apply ours-int8-at-tp-ms` in `state/bench-latency/mnist-cnn`):
    python scripts/compare_plans_finetuned.py --project state/bench-latency/mnist-cnn \
        --plan uniform=stages.1.shortcut.0:32,stem.0:16,stages.0.conv1:16,stages.1.conv1:32 \
        --plan kept=stages.1.shortcut.0:32,stem.0:16,stages.0.conv1:16,stages.1.conv1:20 \
        [--epochs 4 --lr 0.003 --seeds 0 1 --out plans.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pruneops.bench.report import paired_bootstrap_ci  # noqa: E402
from pruneops.checkpoint import load_checkpoint  # noqa: E402
from pruneops.data.splits import load_prepared  # noqa: E402
from pruneops.forward import predict_logits  # noqa: E402
from pruneops.pruning.importance import IMPORTANCES  # noqa: E402
from pruneops.pruning.units import UnitPruner  # noqa: E402
from pruneops.training import (  # noqa: E402
    FitSettings,
    calibration_subset,
    evaluate,
    fit_,
    recalibrate_batchnorm_,
)


def parse_plan(text: str) -> tuple[str, dict[str, int]]:
    """`name=unit:width,unit:width` → (name, widths)."""
    name, _, spec = text.partition("=")
    if not name or not spec:
        raise SystemExit(f"--plan {text!r}: expected NAME=unit:width,unit:width")
    widths = {}
    for item in spec.split(","):
        unit, _, width = item.rpartition(":")
        widths[unit] = int(width)
    return name, widths


def main() -> None:
    """Prints and writes each plan's accuracies and its paired test change against the first plan."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", type=Path, required=True)
    parser.add_argument("--plan", action="append", required=True, help="NAME=unit:width,... (first: reference)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.003)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    plans = dict(parse_plan(p) for p in args.plan)
    reference = next(iter(plans))
    _, train, val, test = load_prepared(args.project / "artifacts/validate")
    results, correct = [], {}
    for seed in args.seeds:
        for name, widths in plans.items():
            model = load_checkpoint(args.project / "artifacts/train/model.safetensors").model
            UnitPruner(model, torch.as_tensor(val.x[:1]), IMPORTANCES.get("l2")).prune_to_(widths)
            recalibrate_batchnorm_(model, calibration_subset(train.x, 1024, seed))
            adaptive_bn = evaluate(model, val)[0]
            fit_(model, train, val, FitSettings(epochs=args.epochs, lr=args.lr, patience=args.epochs, seed=seed))
            model.eval()
            correct[seed, name] = predict_logits(model, test.x).argmax(1).numpy() == test.y
            row = {
                "plan": name,
                "seed": seed,
                "params": sum(p.numel() for p in model.parameters()),
                "val_after_bn_recalibration": adaptive_bn,
                "val_finetuned": evaluate(model, val)[0],
                "test_finetuned": float(correct[seed, name].mean()),
            }
            if name != reference:
                row["test_change_points"] = 100 * (row["test_finetuned"] - correct[seed, reference].mean())
                row["test_change_ci95"] = paired_bootstrap_ci(correct[seed, name], correct[seed, reference])
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"plans": plans, "results": results}, indent=1))


if __name__ == "__main__":
    main()
