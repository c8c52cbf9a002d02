"""How the sensitivity sweep scales on a Ray cluster: one one-CPU node against two, the same curves.

    python studies/compute/measure_compute_scaling.py --max-train-samples 3000 --val-samples 200 --rounds 2

The workload's `validate`, `train` and `sensitivity` params (and its `ours` recipe's pruning method)
make a project under `--work-dir`; `train` runs once here. Then, in alternating rounds, the
`sensitivity` stage runs through the CLI (as DVC runs it) on a local Ray cluster of one node of one
CPU and on one of two such nodes (`pruneops.pipeline.ray_cluster`), and last once with `compute.backend: local`.
Each run's sweep time is the stage's own `seconds.estimator` (joining the cluster, sending the model,
every evaluation); the curves of every run are compared value for value with the local run's.
Writes `report.md` and `results.json` under `--out` (a rerun replaces them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from pruneops.core.io import read_json
from pruneops.pipeline.ray_cluster import local_cluster
from pruneops.pipeline.runner import run_stage
from pruneops.timing.machine import machine_info

ROOT = Path(__file__).resolve().parents[2]


def _project(args: argparse.Namespace) -> Path:
    """The workload's params in `--work-dir`, validated and trained once."""
    bench = yaml.safe_load(Path(args.bench).read_text())
    workload = next(w for w in bench["workloads"] if w["name"] == args.workload)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for section, values in workload["params"].items():
        params[section].update(values)
    for key, value in bench["recipes"]["ours"].items():
        section, _, leaf = key.partition(".")
        if section in ("prune", "sensitivity") and "." not in leaf:
            params[section][leaf] = value
    params["train"]["epochs"] = args.epochs
    if args.max_train_samples:
        params["validate"]["max_train_samples"] = args.max_train_samples
    params["sensitivity"]["threads"] = 1  # each evaluation on one CPU: one task per one-CPU node
    if args.val_samples:
        params["sensitivity"]["val_samples"] = args.val_samples
    work = Path(args.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    for name in ("assets",):
        link = work / name
        if not link.exists():
            link.symlink_to(ROOT / name)
    (work / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    if not (work / "artifacts/train/model.safetensors").is_file():
        for stage in ("validate", "train"):
            run_stage(stage, work / "params.yaml", work)
    return work


def _sweep(work: Path, compute: dict, env: dict | None) -> dict:
    """One run of the sensitivity stage through the CLI with `compute`; its sweep."""
    params = yaml.safe_load((work / "params.yaml").read_text())
    params["compute"] = compute
    path = work / "params-compute.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    cmd = [sys.executable, "-m", "pruneops.cli", "--params", str(path), "--root", str(work), "sensitivity"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"sensitivity failed ({compute}):\n{done.stderr[-3000:]}")
    return read_json(work / "artifacts/sensitivity/sensitivity.json")


def _run_on_cluster(work: Path, nodes: int) -> dict:
    with local_cluster(nodes=nodes, cpus=1) as cluster:
        return _sweep(work, {"backend": "ray", "address": cluster.address}, cluster.env)


def main() -> None:
    """Runs the rounds and writes the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench", default="benchmarks/text.yaml")
    parser.add_argument("--workload", default="rotten-tomatoes-minilm")
    parser.add_argument("--work-dir", default="state/compute-scaling")
    parser.add_argument("--out", default="docs/results/compute")
    parser.add_argument("--rounds", type=int, default=2, help="alternating 1-node/2-node pairs")
    parser.add_argument("--epochs", type=int, default=1, help="train.epochs for the model the sweep prunes")
    parser.add_argument("--max-train-samples", type=int, default=None)
    parser.add_argument("--val-samples", type=int, default=None, help="sensitivity.val_samples (stratified)")
    parser.add_argument(
        "--no-local", dest="local", action="store_false", help="compare runs with the first, not a local run"
    )
    args = parser.parse_args()
    work = _project(args)
    runs = []
    for round_ in range(args.rounds):
        for nodes in (1, 2) if round_ % 2 == 0 else (2, 1):
            sweep = _run_on_cluster(work, nodes)
            runs.append({"round": round_ + 1, "nodes": nodes, "seconds": sweep["seconds"]["estimator"], "sweep": sweep})
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "sweep"}), flush=True)
    # Last: the cluster runs are the comparison that matters. Without it, every run is compared
    # with the first.
    local = _sweep(work, {"backend": "local"}, None) if args.local else None
    reference = local or runs[0]["sweep"]
    for run in runs:
        sweep = run.pop("sweep")
        run["same"] = sweep["units"] == reference["units"] and sweep["weights"] == reference["weights"]
        run["computed_on"] = sweep["computed_on"]
    _write(args, reference, runs, local is not None)


def _write(args: argparse.Namespace, reference: dict, runs: list[dict], against_local: bool) -> None:
    one = [r["seconds"] for r in runs if r["nodes"] == 1]
    two = [r["seconds"] for r in runs if r["nodes"] == 2]
    evaluations = sum(len(c["ratios"]) for c in reference["units"].values())
    result = {
        "command": "python " + " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine_info(1),
        "workload": args.workload,
        "units": len(reference["units"]),
        "evaluations": evaluations,
        "val_samples": reference["val_samples"],
        "local_seconds": reference["seconds"]["estimator"] if against_local else None,
        "runs": runs,
        "speedup_two_over_one": statistics.mean(one) / statistics.mean(two),
        "identical_curves": all(r["same"] for r in runs),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    rows = [f"| {r['round']} | {r['nodes']} | {r['seconds']:.1f} | {'yes' if r['same'] else '**no**'} |" for r in runs]
    compared = "the local run" if against_local else "the first run"
    if against_local:
        local_s = result["local_seconds"]
        against = (
            f"Each run's curves are compared value for value with the same sweep run with `compute.backend: "
            f"local` ({local_s:.1f} s): one Ray node takes {statistics.mean(one) / local_s:.2f}x its time (tasks, "
            f"the object store, starting the workers), two nodes are {local_s / statistics.mean(two):.2f}x faster."
        )
    else:
        against = "Each run's curves are compared value for value with the first run's."
    trained = f" on {args.max_train_samples} training reviews" if args.max_train_samples else ""
    machine = result["machine"]
    lines = [
        "# Scale-out: the sensitivity sweep on a Ray cluster",
        "",
        f"The `evaluate` sweep of the `{args.workload}` workload ({result['units']} units, {evaluations} "
        f"evaluations on {result['val_samples']} validation samples, one thread each) run by the `sensitivity` "
        "stage through the CLI on a local Ray cluster of one node of one CPU and of two such nodes, in "
        "alternating rounds; seconds are the stage's sweep time (joining the cluster, sending the model, "
        f"every evaluation). {against}",
        "",
        f"The model: the workload's MiniLM-L6 fine-tuned for {args.epochs} epoch(s){trained} (the sweep's cost "
        f"does not depend on how well it is trained). Command: `{result['command']}`, {result['date']}, on "
        f"{machine['cpu']} ({machine['cpu_features'] or 'CPU features unknown'}), {machine['cores']} cores.",
        "",
        f"| round | one-CPU nodes | sweep s | curves identical to {compared} |",
        "|---|---|---|---|",
        *rows,
        "",
        f"**Two nodes over one: {result['speedup_two_over_one']:.2f}x** (mean sweep time of each); "
        f"curves identical in every run: {'yes' if result['identical_curves'] else 'no'}.",
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
