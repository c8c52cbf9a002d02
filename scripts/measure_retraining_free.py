"""Retraining-free pruning of a fine-tuned text model, timed and measured (issue 17's stretch).

Run in a project whose `validate` and `train` stages have run and whose params ask for it:
`sensitivity.estimator: fisher` (curves predicted from the Fisher information, no evaluation),
`prune.method: fisher`, `prune.steps: 1`, `prune.epochs_per_step: 0`, a latency target. The script
runs the `sensitivity` and `prune` stages and reports their wall time (nothing is trained), then
compares the pruned model with the dense one: val/test accuracy with paired-bootstrap 95% intervals
of the change, and fp32 ONNX Runtime latency at the benchmark's thread count and batch sizes, both
models timed interleaved in this process at the data's token length. Prints JSON.
"""

import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from pruneops.bench.report import paired_bootstrap_ci
from pruneops.checkpoint import load_checkpoint
from pruneops.config import BenchmarkConfig
from pruneops.data import load_prepared
from pruneops.forward import predict_logits
from pruneops.inputs import timing_inputs
from pruneops.io import Layout
from pruneops.onnx_utils import export_onnx_file, make_session
from pruneops.params import parse_section, read_params
from pruneops.runner import run_stage
from pruneops.stages.benchmark import latency_summary
from pruneops.timing.sessions import measure_latencies


def main() -> None:
    """Prunes without training, then measures what it cost and what it bought."""
    root, params = Path("."), Path("params.yaml")
    layout = Layout(root)
    walls = {}
    for stage in ("sensitivity", "latency", "prune"):
        started = time.perf_counter()
        run_stage(stage, params, root)
        walls[stage] = time.perf_counter() - started
    torch.set_num_threads(2)
    meta, _, val, test = load_prepared(layout.stage_dir("validate"))
    models = {
        "dense": load_checkpoint(layout.stage_dir("train") / "model.safetensors").model,
        "pruned": load_checkpoint(layout.stage_dir("prune") / "model.safetensors").model,
    }
    result: dict = {"wall_s": walls, "wall_s_total": sum(walls.values())}
    correct = {
        name: {split: predict_logits(m, s.x).argmax(1).numpy() == s.y for split, s in (("val", val), ("test", test))}
        for name, m in models.items()
    }
    for split in ("val", "test"):
        result[f"{split}_accuracy"] = {n: float(c[split].mean()) for n, c in correct.items()}
        result[f"{split}_change_points_ci95"] = paired_bootstrap_ci(correct["pruned"][split], correct["dense"][split])
    result["params"] = {n: sum(p.numel() for p in m.parameters()) for n, m in models.items()}
    timing = parse_section("benchmark", read_params(params)["benchmark"], BenchmarkConfig)
    with tempfile.TemporaryDirectory() as tmp:
        sessions = {}
        for name, model in models.items():
            path = Path(tmp) / f"{name}.onnx"
            export_onnx_file(model, meta.input_shape, path, 18)
            sessions[name] = make_session(path, timing.threads)
        x = timing_inputs(models["dense"], meta.input_shape, 1)
        samples = measure_latencies(sessions, x, timing)
    result["latency_ms_p50"] = {
        n: {b: latency_summary(s, b)["p50_ms"] for b, s in per_batch.items()} for n, per_batch in samples.items()
    }
    result["speedup_fp32"] = {
        b: float(np.median(samples["dense"][b]) / np.median(samples["pruned"][b])) for b in timing.batch_sizes
    }
    result["threads"], result["token_length"] = timing.threads, int(meta.input_shape[0])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
