"""The deployed model against dense fp32 and dense dynamic INT8, in one process.

Run in a project whose `export` stage has run (`artifacts/export/{dense_fp32,pruned_deployed}.onnx`).
The benchmark stage times dense fp32 beside the deployed model; this adds dense INT8 (ONNX Runtime
dynamic quantization of `dense_fp32.onnx`, per-channel int8 weights, as `quantize.method: dynamic`
makes it), which the issue's "≥ 2.5× over dense INT8" needs. It reports the val/test accuracy of each,
the paired-bootstrap 95% interval of each change against dense fp32, and the p50 latency at the
benchmark's thread count and batch sizes, the three models timed interleaved. It prints JSON.
"""

import json
import tempfile
from pathlib import Path

from pruneops.compare.report import paired_bootstrap_ci
from pruneops.config import BenchmarkConfig
from pruneops.core.inputs import rows
from pruneops.core.io import Layout
from pruneops.core.params import parse_section, read_params
from pruneops.data import load_prepared
from pruneops.runtimes.onnxruntime.files import make_session, ort_logits
from pruneops.runtimes.onnxruntime.timing import measure_latencies
from pruneops.task.classification.benchmark import latency_summary


def main() -> None:
    """Quantizes dense, then measures the three models side by side."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    layout = Layout(Path("."))
    timing = parse_section("benchmark", read_params(Path("params.yaml"))["benchmark"], BenchmarkConfig)
    _, _, val, test = load_prepared(layout.stage_dir("validate"))
    export = layout.stage_dir("export")
    with tempfile.TemporaryDirectory() as tmp:
        dense_int8 = Path(tmp) / "dense_int8.onnx"
        quantize_dynamic(
            str(export / "dense_fp32.onnx"), str(dense_int8), per_channel=True, weight_type=QuantType.QInt8
        )
        paths = {
            "dense_fp32": export / "dense_fp32.onnx",
            "dense_int8": dense_int8,
            "pruned_deployed": export / "pruned_deployed.onnx",
        }
        sessions = {n: make_session(p, timing.threads) for n, p in paths.items()}
        result: dict = {"size_bytes": {n: p.stat().st_size for n, p in paths.items()}}
        for split_name, split in (("val", val), ("test", test)):
            correct = {n: ort_logits(s, split.x).argmax(1) == split.y for n, s in sessions.items()}
            result[f"{split_name}_accuracy"] = {n: float(c.mean()) for n, c in correct.items()}
            result[f"{split_name}_change_points_ci95"] = {
                n: paired_bootstrap_ci(c, correct["dense_fp32"]) for n, c in correct.items() if n != "dense_fp32"
            }
        samples = measure_latencies(sessions, rows(test.x, slice(0, 1)), timing)  # full length: padded
    result["latency_ms_p50"] = {
        n: {b: latency_summary(s, b)["p50_ms"] for b, s in per.items()} for n, per in samples.items()
    }
    p50 = result["latency_ms_p50"]
    result["deployed_speedup"] = {
        ref: {b: p50[ref][b] / p50["pruned_deployed"][b] for b in timing.batch_sizes}
        for ref in ("dense_fp32", "dense_int8")
    }
    result["timing"] = timing.model_dump()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
