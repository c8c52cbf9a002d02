"""How much of a MAC reduction can turn into fp32 speed-up on this machine: the `mnist-wide.yaml` CNN.

Usage: `python scripts/measure_mac_ratio.py --out DIR [--plans 48] [--depth-plans 12] [--seed 0]`
(nothing downloaded).

Issue 15 asks the wide CNN's fp32 rows for speed-up / MAC reduction >= 1.0 at 20.48x batch-1.
That ratio is the pruned model's MAC rate over dense's (`(t_dense / t_pruned) / (M_dense / M_pruned)`
`= (M_pruned / t_pruned) / (M_dense / t_dense)`), so it is >= 1 only if the pruned model runs as
many MACs per millisecond as dense. This script measures both halves of that on this machine,
with random weights (latency does not depend on their values):

1. Whole-model exports of random width plans (each unit's keep drawn log-uniformly between the
   `prune.max_unit_ratio: 0.94` bound and its size), uniform cuts and depth cuts (the stage-0
   block removed, which this graph allows exactly), timed interleaved in one
   process with dense (ONNX Runtime, 1 thread, batch 1 and 64, as the benchmark): speed-up, MAC
   reduction and their ratio per plan, and the best ratio in each band of batch-1 speed-up.
2. Each convolution's MAC rate in context (ONNX Runtime's profiler on every export, the fused
   channel-blocked kernels the benchmark runs): in dense against the best it reached in any plan.
   Profiled sessions run apart from the interleaved timing (and the profiler adds to the shortest
   kernels), so these say where time goes, not what the ratios are.

Writes `DIR/mac_ratio.json`, `DIR/mac_ratio.md` and `DIR/mac_ratio.png` (ratio against batch-1
speed-up, the 1.0 line and the 20.48x mark).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pruneops.config import BenchmarkConfig  # noqa: E402
from pruneops.models.registry import ModelSpec, create_model  # noqa: E402
from pruneops.onnx_utils import export_onnx_file  # noqa: E402
from pruneops.profiling import count_macs  # noqa: E402
from pruneops.pruning.importance import IMPORTANCES  # noqa: E402
from pruneops.pruning.units import UnitPruner  # noqa: E402
from pruneops.timing.machine import machine_info  # noqa: E402
from pruneops.timing.sessions import measured_latency  # noqa: E402

SHAPE = [1, 28, 28]
SPEC = ModelSpec("cnn", SHAPE, 10, {"widths": [64, 128], "blocks": 1})
TARGET_SPEEDUP = 20.48  # issue 15's batch-1 mark on this CNN
FIRST_BLOCK_UNIT = "stages.0.conv1"  # the unit inside the stage-0 block's residual branch
BANDS = [(1.0, 5.0), (5.0, 10.0), (10.0, TARGET_SPEEDUP), (TARGET_SPEEDUP, math.inf)]
# The batch-1 runs are short, the batch-64 ones up to ~0.2 s each: fewer repeats there.
TIMING = {
    1: BenchmarkConfig(threads=1, batch_sizes=[1], warmup=20, repeats=100, rounds=5),
    64: BenchmarkConfig(threads=1, batch_sizes=[64], warmup=3, repeats=10, rounds=3),
}


def pruned(dense: torch.nn.Module, example: torch.Tensor, keep: dict[str, int]) -> torch.nn.Module:
    """A copy of `dense` with each unit cut to `keep[unit]` channels; 0 for the stage-0 block removes the block.

    That block has an identity shortcut after the stem's ReLU, so without its residual branch it
    passes its input through unchanged (`relu(x + 0) = x` for `x >= 0`): removing it is a depth cut
    the graph allows exactly. PruneOps itself prunes channels and heads, not blocks.
    """
    twin = copy.deepcopy(dense)
    if keep.get(FIRST_BLOCK_UNIT) == 0:
        twin.stages[0] = torch.nn.Identity()
    UnitPruner(twin, example, IMPORTANCES.get("l2")).prune_to_({n: k for n, k in keep.items() if k})
    return twin.eval()


def draw_plans(sizes: dict[str, int], count: int, depth: int, seed: int) -> dict[str, dict[str, int]]:
    """Uniform cuts and `count` random plans: each unit's keep log-uniform from the 0.94 bound up.

    Every other random plan is snapped to multiples of 8, the channel block of ONNX Runtime's
    AVX2 kernels (odd counts run as the next block up), so the fast plans are well sampled too.
    `depth` more plans remove the stage-0 block (see `pruned`), their other units at 8 to half size.
    """
    rng = random.Random(seed)
    plans = {
        "every unit 8": {n: min(8, s) for n, s in sizes.items()},
        "every unit 16": {n: min(16, s) for n, s in sizes.items()},
        "uniform 75 % cut": {n: s // 4 for n, s in sizes.items()},
        "uniform 50 % cut": {n: s // 2 for n, s in sizes.items()},
    }
    low = {n: max(1, round(0.06 * s)) for n, s in sizes.items()}
    for i in range(count):
        # The second half is drawn among deep cuts (at most a quarter kept), where 20.48x lies.
        top = {n: s if i < count // 2 else max(low[n], s // 4) for n, s in sizes.items()}
        keep = {n: round(math.exp(rng.uniform(math.log(low[n]), math.log(top[n])))) for n in sizes}
        if i % 2:
            keep = {n: min(sizes[n], max(8, 8 * round(k / 8))) for n, k in keep.items()}
        plans[f"random {i:02d}"] = keep
    # Depth cuts on top: the stage-0 block removed, the other units drawn among deep cuts, snapped.
    for i in range(depth):
        keep = {n: round(math.exp(rng.uniform(math.log(8), math.log(max(8, s // 2))))) for n, s in sizes.items()}
        plans[f"no block 0, {i:02d}"] = {n: 0 if n == FIRST_BLOCK_UNIT else 8 * round(k / 8) for n, k in keep.items()}
    return plans


def conv_kernels(path: Path, runs: int = 300) -> dict[str, tuple[float, float]]:
    """Per Conv node of an ONNX model as ONNX Runtime runs it: (median kernel ms in context, MMACs per sample).

    From ONNX Runtime's profiler (batch 1, 1 thread, full optimisation, so each Conv is the fused,
    channel-blocked kernel the benchmark times); MACs from the kernel's weight and output shapes.
    """
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = 1, 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.enable_profiling, opts.log_severity_level = True, 3
    opts.profile_file_prefix = str(path.with_suffix(""))
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    feed = {session.get_inputs()[0].name: np.zeros([1, *SHAPE], np.float32)}
    for _ in range(runs):
        session.run(None, feed)
    events = json.loads(Path(session.end_profiling()).read_text())
    times: dict[str, list[float]] = {}
    mmacs: dict[str, float] = {}
    for e in events:
        if e.get("cat") != "Node" or e["args"].get("op_name") != "Conv" or not e["name"].endswith("_kernel_time"):
            continue
        name = e["name"].removesuffix("_kernel_time")
        weight = e["args"]["input_type_shape"][1]["float"]
        out = e["args"]["output_type_shape"][0]["float"]
        mmacs[name] = math.prod(weight) * math.prod(out[2:]) / 1e6
        times.setdefault(name, []).append(e["dur"] / 1e3)
    return {n: (float(np.median(t[len(t) // 5 :])), mmacs[n]) for n, t in times.items()}


def layer_rates(kernels: dict[str, dict[str, tuple[float, float]]]) -> list[dict]:
    """Per Conv of dense: its in-context MAC rate (GMAC/s), and the best rate it ran at in any plan."""
    rows = []
    for node, (ms, mmacs) in kernels["dense"].items():
        runs = [
            (k[node][1] / k[node][0], plan, k[node][1]) for plan, k in kernels.items() if plan != "dense" and node in k
        ]
        rate, plan, plan_mmacs = max(runs)
        rows.append(
            {
                "node": node,
                "dense_ms": ms,
                "dense_mmacs": mmacs,
                "dense_gmacs": mmacs / ms,
                "best_pruned_gmacs": rate,
                "best_pruned_plan": plan,
                "best_pruned_mmacs": plan_mmacs,
            }
        )
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    """Per band of batch-1 speed-up: the best ratio (batch 1 and 64) and the least MAC reduction.

    A ratio of 1.0 at speed-up S needs a MAC reduction of at most S, so the least MAC reduction
    in a band says how far its plans were from keeping enough MACs for it.
    """
    out = []
    for low, high in BANDS:
        inside = [r for r in rows if low <= r["speedup_b1"] < high]
        best = max(inside, key=lambda r: r["ratio_b1"], default=None)
        out.append(
            {
                "band": [low, high],
                "plans": len(inside),
                "best_ratio_b1": best and best["ratio_b1"],
                "best_plan": best and best["plan"],
                "least_mac_reduction": min((r["mac_reduction"] for r in inside), default=None),
                "best_ratio_b64": max((r["ratio_b64"] for r in inside), default=None),
            }
        )
    return out


def ratio_bounds(rows: list[dict], layers: list[dict], dense_ms: float, dense_macs: int) -> list[dict]:
    """Per structure (channels only; the stage-0 block removed): the most a plan at 20.48x could reach.

    The structure's fastest plan spends some time on anything but its MACs (the call, pooling,
    reorders, the classifier): at least its time less its MACs at the best conv rate seen in
    context, `e_max`. Widening layers adds MACs and does not shrink that, so a plan at 20.48x has
    at most `budget - fixed` ms for MACs, `e_max` times that in MACs, against the 1/20.48 of
    dense's that a ratio of 1.0 needs. `needed_gmacs` asks it the other way, with no assumed rate:
    the rate at which the MACs a ratio of 1.0 needs beyond the fastest plan's would have to run.
    """
    e_max = max(max(r["dense_gmacs"], r["best_pruned_gmacs"]) for r in layers)  # MMACs per ms
    budget, needed = dense_ms / TARGET_SPEEDUP, dense_macs / TARGET_SPEEDUP / 1e6
    out = []
    for label, depth in (("channels only", False), ("stage-0 block removed", True)):
        family = [r for r in rows if (r["widths"].get(FIRST_BLOCK_UNIT) == 0) == depth]
        if not family:  # --depth-plans 0
            continue
        floor = min(family, key=lambda r: r["ms_b1"])
        fixed = floor["ms_b1"] - floor["macs"] / 1e6 / e_max
        best = max((r for r in family if r["speedup_b1"] >= TARGET_SPEEDUP), key=lambda r: r["ratio_b1"], default=None)
        out.append(
            {
                "structure": label,
                "floor_plan": floor["plan"],
                "floor_ms": floor["ms_b1"],
                "floor_macs": floor["macs"],
                "fixed_ms_at_least": fixed,
                "best_conv_gmacs": e_max,
                "bound": max(0.0, budget - fixed) * e_max / needed,
                # The rate the MACs added to the fastest plan would need for a ratio of 1.0.
                "needed_gmacs": (needed - floor["macs"] / 1e6) / (budget - floor["ms_b1"]),
                "best_measured": best and best["ratio_b1"],
            }
        )
    return out


def write_markdown(path: Path, result: dict) -> None:
    """The report: machine, command, per-layer rates, bands, and every plan."""
    m = result["machine"]
    lines = [
        "# fp32 speed-up / MAC reduction on the wide MNIST CNN\n",
        f"`{result['command']}`, {m.get('date', '')}, {m.get('cpu', '')} ({m.get('cpu_features', '')}), "
        f"{m.get('cores', '')} cores, ONNX Runtime {m.get('onnxruntime', '')}, 1 thread; dense fp32 "
        f"{result['dense_ms'][1]:.4f} ms at batch 1 ({result['dense_gmacs']:.1f} GMAC/s over the whole model), "
        f"{result['dense_ms'][64]:.3f} ms at 64. Random weights; {len(result['plans'])} plans.\n",
        "## Each convolution in context (ONNX Runtime's profiler, batch 1)\n",
        "| Conv node (fused) | dense MMACs | dense ms | dense GMAC/s | best GMAC/s in any plan (plan, MMACs) |",
        "|---|---|---|---|---|",
    ]
    for r in result["layers"]:
        lines.append(
            f"| `{r['node']}` | {r['dense_mmacs']:.2f} | {r['dense_ms']:.4f} | {r['dense_gmacs']:.1f} | "
            f"{r['best_pruned_gmacs']:.1f} ({r['best_pruned_plan']}, {r['best_pruned_mmacs']:.2f}) |"
        )
    lines += [
        "",
        f"## The most a plan at {TARGET_SPEEDUP}× could reach (`ratio_bounds`)\n",
        f"The best conv rate seen in context: {result['bounds'][0]['best_conv_gmacs']:.1f} GMAC/s. '1.0 needs': "
        "the rate at which the MACs a ratio of 1.0 needs beyond the fastest plan's would have to run.\n",
        "| structure | fastest plan: ms, MACs | time not on MACs ≥ (ms) | bound | best measured | 1.0 needs (GMAC/s) |",
        "|---|---|---|---|---|---|",
    ]
    for b in result["bounds"]:
        best = "–" if b["best_measured"] is None else f"{b['best_measured']:.2f}"
        lines.append(
            f"| {b['structure']} | {b['floor_plan']}: {b['floor_ms']:.4f}, {b['floor_macs']:,} | "
            f"{b['fixed_ms_at_least']:.4f} | {b['bound']:.2f} | {best} | {b['needed_gmacs']:.0f} |"
        )
    lines += [
        "",
        "## Whole models, interleaved: the best ratio per band of batch-1 speed-up\n",
        "A ratio of 1.0 at a speed-up S needs a MAC reduction of at most S: the least MAC reduction "
        "among a band's plans is the closest any came.\n",
        "| batch-1 speed-up | plans | best ratio b1 (plan) | least MAC reduction | best ratio b64 |",
        "|---|---|---|---|---|",
    ]
    for b in result["bands"]:
        high = "∞" if math.isinf(b["band"][1]) else f"{b['band'][1]:g}"
        ratio = "–" if b["best_ratio_b1"] is None else f"{b['best_ratio_b1']:.2f} ({b['best_plan']})"
        bound = "–" if b["least_mac_reduction"] is None else f"{b['least_mac_reduction']:.1f}×"
        b64 = "–" if b["best_ratio_b64"] is None else f"{b['best_ratio_b64']:.2f}"
        lines.append(f"| {b['band'][0]:g}–{high}× | {b['plans']} | {ratio} | {bound} | {b64} |")
    lines += [
        "",
        "| plan | widths | MACs | b1 ms | b1 × | b64 × | MAC reduction | ratio b1 | ratio b64 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(result["plans"], key=lambda r: r["speedup_b1"]):
        lines.append(
            f"| {r['plan']} | {' / '.join(str(w) for w in r['widths'].values())} | {r['macs']:,} | "
            f"{r['ms_b1']:.4f} | {r['speedup_b1']:.2f} | {r['speedup_b64']:.2f} | {r['mac_reduction']:.2f} | "
            f"{r['ratio_b1']:.2f} | {r['ratio_b64']:.2f} |"
        )
    lines.append(
        f"\nWidths are in the order {', '.join(result['units'])}; 0 for {FIRST_BLOCK_UNIT}: "
        "the stage-0 block removed.\n"
    )
    path.write_text("\n".join(lines))


def plot(path: Path, rows: list[dict]) -> None:
    """Ratio against batch-1 speed-up, both batch sizes, with the 1.0 line and the 20.48x mark."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([r["speedup_b1"] for r in rows], [r["ratio_b1"] for r in rows], s=18, label="batch 1")
    ax.scatter([r["speedup_b1"] for r in rows], [r["ratio_b64"] for r in rows], s=18, marker="x", label="batch 64")
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="speed-up = MAC reduction")
    ax.axvline(TARGET_SPEEDUP, color="r", lw=0.8, ls=":", label=f"{TARGET_SPEEDUP}× at batch 1")
    ax.set_xscale("log")
    ax.set_xlabel("batch-1 speed-up over dense fp32 (measured)")
    ax.set_ylabel("speed-up / MAC reduction")
    ax.set_title("fp32 plans of the wide MNIST CNN, ONNX Runtime 1 thread")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    """Measures, prints the bands and writes the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plans", type=int, default=48, help="random plans besides the four uniform cuts")
    parser.add_argument("--depth-plans", type=int, default=12, help="plans without the stage-0 block")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    dense = create_model(SPEC).eval()
    example = torch.zeros(1, *SHAPE)
    sizes = {n: u.size for n, u in UnitPruner(dense, example, IMPORTANCES.get("l2")).units().items()}
    plans = draw_plans(sizes, args.plans, args.depth_plans, args.seed)
    models = {"dense": dense, **{name: pruned(dense, example, keep) for name, keep in plans.items()}}
    macs = {name: count_macs(m, SHAPE) for name, m in models.items()}
    with torch.no_grad():
        ms = measured_latency(models, SHAPE, TIMING)
        with tempfile.TemporaryDirectory(prefix="mac-ratio-") as tmp:
            kernels = {}
            for name, model in models.items():
                path = Path(tmp) / f"{len(kernels):03d}.onnx"
                export_onnx_file(model, SHAPE, path, 18)
                kernels[name] = conv_kernels(path)
    layers = layer_rates(kernels)
    for r in layers:
        print(
            f"{r['node'][:48]:48s} dense {r['dense_gmacs']:5.1f} GMAC/s in context, best in a plan "
            f"{r['best_pruned_gmacs']:5.1f} ({r['best_pruned_plan']}, {r['best_pruned_mmacs']:.2f} MMACs)"
        )
    rows = []
    for name, keep in plans.items():
        reduction = macs["dense"] / macs[name]
        s1, s64 = ms["dense"][1] / ms[name][1], ms["dense"][64] / ms[name][64]
        rows.append(
            {
                "plan": name,
                "widths": keep,
                "macs": macs[name],
                "ms_b1": ms[name][1],
                "ms_b64": ms[name][64],
                "speedup_b1": s1,
                "speedup_b64": s64,
                "mac_reduction": reduction,
                "ratio_b1": s1 / reduction,
                "ratio_b64": s64 / reduction,
            }
        )
    dense_gmacs = macs["dense"] / 1e6 / ms["dense"][1]
    bands = summarise(rows)
    for b in bands:
        print(
            f"speed-up {b['band'][0]:g}-{b['band'][1]:g}x: {b['plans']} plans, best ratio b1 {b['best_ratio_b1']} "
            f"({b['best_plan']}), least MAC reduction {b['least_mac_reduction']}, b64 {b['best_ratio_b64']}"
        )
    bounds = ratio_bounds(rows, layers, ms["dense"][1], macs["dense"])
    for b in bounds:
        print(
            f"{b['structure']}: at {TARGET_SPEEDUP}x the ratio is at most {b['bound']:.2f} "
            f"(best measured {b['best_measured']}); 1.0 needs the MACs beyond the fastest plan's at "
            f"{b['needed_gmacs']:.0f} GMAC/s, the best conv ran {b['best_conv_gmacs']:.1f}"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python scripts/measure_mac_ratio.py " + " ".join(sys.argv[1:])
    result = {
        "command": command,
        "machine": machine_info(1),
        "units": list(sizes),
        "dense_macs": macs["dense"],
        "dense_ms": ms["dense"],
        "dense_gmacs": dense_gmacs,
        "layers": layers,
        "bands": bands,
        "bounds": bounds,
        "plans": rows,
    }
    (args.out / "mac_ratio.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    write_markdown(args.out / "mac_ratio.md", result)
    plot(args.out / "mac_ratio.png", rows)
    print(f"wrote {args.out}/mac_ratio.{{json,md,png}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
