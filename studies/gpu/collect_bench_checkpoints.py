"""Copies the checkpoints of `pruneops bench` rows out of its DVC run-cache, for another machine.

Each bench workload keeps a DVC project under `state/bench-*/WORKLOAD` whose experiments are the
rows; their `artifacts/train` (dense) and `artifacts/finetune` (pruned) outputs sit in that
project's cache. This writes `OUT/WORKLOAD--VARIANT/model.safetensors` (+ its `.sha256`), the layout
`studies/gpu/measure_gpu.py --checkpoints OUT` reads.

Usage:
    python studies/gpu/collect_bench_checkpoints.py --bench-dir state/bench-families --out .gpu/ckpt
        mnist-vit:dense mnist-vit:tp50-r8 ...
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

import yaml


def _git(workspace: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(workspace), *args], capture_output=True, text=True, check=True).stdout


def collect(workspace: Path, variant: str, dest: Path) -> list[str]:
    """Copies the newest row's model (train stage for `dense`, finetune otherwise) to `dest`."""
    # Newest first: a workspace keeps every run's experiments, and a rerun's row is the one wanted.
    refs = _git(workspace, "for-each-ref", "--sort=-committerdate", "--format=%(refname)", "refs/exps").split()
    matches = [r for r in refs if r.endswith("/" + variant)]
    if not matches:
        have = sorted(r.rsplit("/", 1)[1] for r in refs)
        raise SystemExit(f"{workspace}: no experiment named {variant} (have: {have})")
    lock = yaml.safe_load(_git(workspace, "show", f"{matches[0]}:dvc.lock"))
    stage = "train" if variant == "dense" else "finetune"
    out = next(o for o in lock["stages"][stage]["outs"] if o["path"] == f"artifacts/{stage}")
    cache = workspace / ".dvc" / "cache" / "files" / "md5"
    listing = json.loads((cache / out["md5"][:2] / out["md5"][2:]).read_text())
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for entry in listing:
        if entry["relpath"].startswith("model.safetensors"):
            shutil.copy(cache / entry["md5"][:2] / entry["md5"][2:], dest / entry["relpath"])
            copied.append(entry["relpath"])
    return copied


def main() -> int:
    """Copies every WORKLOAD:VARIANT named on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("rows", nargs="+", help="WORKLOAD:VARIANT")
    args = parser.parse_args()
    for row in args.rows:
        workload, _, variant = row.partition(":")
        copied = collect(args.bench_dir / workload, variant, args.out / f"{workload}--{variant}")
        print(f"{row}: {', '.join(copied)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
