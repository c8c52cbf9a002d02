"""Do per-layer MLP widths beat one uniform width at the same decode time? A measurement, not a feature.

    python scripts/measure_heterogeneous_widths.py --config benchmarks/decoders/llm.yaml --widths 1024 768

For each uniform MLP width W the decoder keeps W x layers neurons in all. Three cuts keep that many,
each with activation-aware importance (Wanda/FLAP) and the least-squares reconstruction of the down
projection, and no recovery:

- `uniform`: W neurons in every layer (what a config expresses; what PruneOps ships);
- `standardised`: FLAP's adaptive structure: each layer's neuron scores standardised (z-scores),
  the global top W x layers kept, each layer's count rounded to a multiple of 64;
- `mean-normalised`: the same with scores divided by their layer's mean.

Quality: perplexity on the workload's validation and test blocks (the bench's split), the ratio to
uniform paired over blocks with a bootstrap interval. Time: the same total MLP weights give the same
predicted decode time under the cost model (linear in layer weights); what odd per-layer widths cost
in ONNX Runtime is measured directly: one token through each layer's gate/up/down MatMuls at its
width (one thread, interleaved rounds), summed over layers, against the uniform sum.
Writes `docs/results/llm-widths/report.md` and `results.json`.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from datetime import date
from pathlib import Path

import numpy as np
import torch

from pruneops.bench.decoder import load_bench_config, workload_data
from pruneops.models.decoders import keep_inputs_, keep_outputs_, layout_of, load_causal_lm, weight_out_in
from pruneops.models.language import block_losses, paired_ratio_interval, perplexity_from_losses
from pruneops.pruning import decoder as cuts
from pruneops.timing.machine import machine_info

STEP = 64  # per-layer widths in multiples of this (what the CPU kernels tile well)


def layer_scores(model: torch.nn.Module, calibration: cuts.Calibration) -> list[torch.Tensor]:
    """Activation-aware neuron scores of every layer's MLP."""
    layout, score = layout_of(model), cuts.NEURON_IMPORTANCES.get("activation")
    out = []
    for index, layer in enumerate(layout.decoder_layers(model)):
        inputs, down = layout.mlp_modules(layer)
        out.append(score([weight_out_in(m) for m in inputs], weight_out_in(down), calibration.mlp[index]))
    return out


def allocate(scores: list[torch.Tensor], total: int, normalise: str) -> list[int]:
    """Per-layer widths (multiples of STEP, summing to `total`) from a global ranking of normalised scores."""
    if normalise == "standardised":
        normed = [(s - s.mean()) / s.std() for s in scores]
    else:
        normed = [s / s.mean() for s in scores]
    flat = torch.cat(normed)
    threshold = flat.topk(total).values[-1]
    counts = np.array([int((s >= threshold).sum()) for s in normed], dtype=float)
    width = len(scores[0])
    widths = np.clip(np.round(counts / STEP) * STEP, STEP, width).astype(int)
    residual = counts - widths
    while widths.sum() != total:  # move one step at a time where rounding erred most
        grow = widths.sum() < total
        order = np.argsort(-residual if grow else residual)
        for i in order:
            if (grow and widths[i] < width) or (not grow and widths[i] > STEP):
                widths[i] += STEP if grow else -STEP
                residual[i] += -STEP if grow else STEP
                break
    return widths.tolist()


def cut_per_layer(
    dense: torch.nn.Module, calibration: cuts.Calibration, scores: list[torch.Tensor], widths: list[int]
) -> torch.nn.Module:
    """A copy with layer i's MLP cut to widths[i] by its scores, the down projection re-solved."""
    model = copy.deepcopy(dense)
    layout = layout_of(model)
    for index, layer in enumerate(layout.decoder_layers(model)):
        inputs, down = layout.mlp_modules(layer)
        keep = scores[index].topk(widths[index]).indices.sort().values
        cuts.least_squares_(down, calibration.mlp[index], keep)
        for module in inputs:
            keep_outputs_(module, keep)
        keep_inputs_(down, keep)
    return model


def mlp_step_seconds(hidden: int, widths: list[int], rounds: int, calls: int) -> dict[int, float]:
    """Median seconds of one token through gate, up (multiplied) and down MatMuls at each width, ORT, 1 thread."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    sessions = {}
    for width in sorted(set(widths)):
        weights = [
            numpy_helper.from_array(rng.standard_normal((hidden, width), dtype=np.float32), "wg"),
            numpy_helper.from_array(rng.standard_normal((hidden, width), dtype=np.float32), "wu"),
            numpy_helper.from_array(rng.standard_normal((width, hidden), dtype=np.float32), "wd"),
        ]
        nodes = [
            helper.make_node("MatMul", ["x", "wg"], ["g"]),
            helper.make_node("MatMul", ["x", "wu"], ["u"]),
            helper.make_node("Mul", ["g", "u"], ["h"]),
            helper.make_node("MatMul", ["h", "wd"], ["y"]),
        ]
        graph = helper.make_graph(
            nodes,
            "mlp",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, hidden])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, hidden])],
            weights,
        )
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
        sessions[width] = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        onnx.checker.check_model(model)
    x = {"x": rng.standard_normal((1, hidden), dtype=np.float32)}
    times: dict[int, list[float]] = {w: [] for w in sessions}
    for _ in range(rounds):  # interleaved: drift hits every width alike
        for width, session in sessions.items():
            session.run(None, x)
            start = time.perf_counter()
            for _ in range(calls):
                session.run(None, x)
            times[width].append((time.perf_counter() - start) / calls)
    return {w: float(np.median(t)) for w, t in times.items()}


def _row(name: str, widths: list[int], val: np.ndarray, test: np.ndarray, ref: dict | None, tokens: dict) -> dict:
    row = {"cut": name, "widths": widths}
    for split, losses in (("val", val), ("test", test)):
        ppl = perplexity_from_losses(losses, tokens[split])
        row[f"{split}_perplexity"] = [ppl.value, ppl.low, ppl.high]
        row[f"_{split}"] = ppl
        if ref is not None:
            row[f"{split}_ratio_to_uniform"] = list(paired_ratio_interval(ppl, ref[f"_{split}"]))
    return row


def _report(results: dict) -> str:
    lines = [
        "# Per-layer MLP widths against one uniform width (SmolLM2-135M)",
        "",
        f"Reproduce: `{results['command']}`",
        "",
        f"Machine: {results['machine']['cpu']}, {results['machine'].get('cores', '?')} cores; {results['date']}; "
        f"wall time {results['wall_s'] / 60:.0f} min. Calibration: {results['calibration_blocks']} training blocks; "
        f"validation {results['val_blocks']} and test {results['test_blocks']} blocks of {results['block_length']} "
        "tokens (the bench's split). Every cut: activation-aware importance and least-squares reconstruction of the "
        "down projection, no recovery. Ratios are to uniform, paired over blocks, with 95 % bootstrap intervals.",
        "",
        "| total (uniform width) | cut | val ppl | test ppl [95% CI] | test ppl / uniform [95% CI] | "
        "MLP time per token, ORT (ms) | vs uniform | widths (min-max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for group in results["groups"]:
        for row in group["rows"]:
            ratio = row.get("test_ratio_to_uniform")
            ratio_text = f"{ratio[0]:.3f} [{ratio[1]:.3f}, {ratio[2]:.3f}]" if ratio else "1"
            t, low, high = row["test_perplexity"]
            lines.append(
                f"| {group['uniform_width']} x {len(row['widths'])} | {row['cut']} | {row['val_perplexity'][0]:.2f} | "
                f"{t:.2f} [{low:.2f}, {high:.2f}] | {ratio_text} | {row['mlp_ms']:.3f} | "
                f"{row['mlp_ms'] / group['rows'][0]['mlp_ms']:.3f}x | {min(row['widths'])}-{max(row['widths'])} |"
            )
    lines += ["", "Per-layer widths (layer 0 first):", ""]
    for group in results["groups"]:
        for row in group["rows"][1:]:
            lines.append(f"- {group['uniform_width']}, {row['cut']}: {row['widths']}")
    lines += ["", results["verdict"], ""]
    return "\n".join(lines)


def _verdict(groups: list[dict]) -> str:
    better = []
    for group in groups:
        for row in group["rows"][1:]:
            ratio, low, high = row["test_ratio_to_uniform"]
            if high < 1.0 and row["mlp_ms"] <= group["rows"][0]["mlp_ms"] * 1.02:
                better.append(f"{row['cut']} at {group['uniform_width']} ({ratio:.3f})")
    if better:
        return "**Per-layer widths win** beyond the interval at no measured MLP-time cost: " + "; ".join(better) + "."
    return (
        "**Per-layer widths do not win** here: no heterogeneous cut has a test perplexity below uniform's beyond the "
        "interval at the same MLP time, so PruneOps keeps uniform shapes (which every runtime loads from the config)."
    )


def main() -> None:
    """Cuts, scores and times each allocation; writes the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="benchmarks/decoders/llm.yaml")
    parser.add_argument("--widths", type=int, nargs="+", default=[1024, 768])
    parser.add_argument("--out", default="docs/results/llm-widths")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(2)
    config = load_bench_config(Path(args.config))
    dense, tokenizer = load_causal_lm(config.model)
    data = workload_data(config, tokenizer)
    calibration = cuts.calibrate(dense, data.calibration)
    scores = layer_scores(dense, calibration)
    layers, hidden = len(scores), dense.config.hidden_size
    tokens = {"val": data.val.shape[0] * (data.val.shape[1] - 1), "test": data.test.shape[0] * (data.test.shape[1] - 1)}
    plans = {
        w: {
            "uniform": [w] * layers,
            **{n: allocate(scores, w * layers, n) for n in ("standardised", "mean-normalised")},
        }
        for w in args.widths
    }
    step = mlp_step_seconds(
        hidden, [w for p in plans.values() for ws in p.values() for w in ws], args.rounds, args.calls
    )
    groups = []
    for width, cuts_at in plans.items():
        rows: list[dict] = []
        for name, widths in cuts_at.items():
            model = cut_per_layer(dense, calibration, scores, widths)
            val, test = block_losses(model, data.val), block_losses(model, data.test)
            rows.append(_row(name, widths, val, test, rows[0] if rows else None, tokens))
            rows[-1]["mlp_ms"] = 1000 * sum(step[w] for w in widths)
            print(f"{width} {name}: test ppl {rows[-1]['test_perplexity'][0]:.2f}, MLP {rows[-1]['mlp_ms']:.3f} ms")
        groups.append({"uniform_width": width, "rows": rows})
    for group in groups:
        for row in group["rows"]:
            row.pop("_val"), row.pop("_test")
    results = {
        "command": "python scripts/measure_heterogeneous_widths.py "
        + " ".join(["--config", args.config, "--widths", *map(str, args.widths)]),
        "machine": {**machine_info(1), "python": platform.python_version()},
        "date": date.today().isoformat(),
        "calibration_blocks": int(data.calibration.shape[0]),
        "val_blocks": int(data.val.shape[0]),
        "test_blocks": int(data.test.shape[0]),
        "block_length": int(data.val.shape[1]),
        "mlp_step_ms": {str(w): 1000 * s for w, s in sorted(step.items())},
        "groups": groups,
        "wall_s": time.perf_counter() - started,
    }
    results["verdict"] = _verdict(groups)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "report.md").write_text(_report(results))
    print(results["verdict"])


if __name__ == "__main__":
    main()
