"""Where static INT8 stops paying: fp32, static INT8, and static INT8 with the stem conv kept fp32.

Usage: `python scripts/measure_int8_stem.py MODEL.onnx [MODEL.onnx ...]` (fp32 exports taking one
image input of the same shape, e.g. a bench run's `results/<variant>/artifacts/export/pruned_fp32.onnx`).
Each model is quantized by `quantize.method: static`'s quantizer with the stage's default settings
(calibrated here on 64 random inputs: their values do not change what the INT8 graph costs), and
again with its stem (ungrouped convolutions over at most 4 input channels) excluded.
All forms of all models are timed interleaved in one process at batch 1 and 64, one thread. Prints
JSON: median ms per model, form and batch size.
"""

import json
import sys
import tempfile
from pathlib import Path

import numpy as np


def stem_convs(path: Path) -> list[str]:
    """The ungrouped Conv nodes over at most 4 input channels (an image model's first layer)."""
    import onnx

    model = onnx.load(str(path))
    weights = {i.name: i for i in model.graph.initializer}
    return [
        n.name
        for n in model.graph.node
        if n.op_type == "Conv"
        and n.input[1] in weights
        and weights[n.input[1]].dims[1] <= 4
        and next((a.i for a in n.attribute if a.name == "group"), 1) == 1
    ]


def main(paths: list[Path]) -> None:
    """Quantizes each model both ways and times every form interleaved."""
    import onnxruntime as ort

    from pruneops.config import BenchmarkConfig, QuantizeConfig
    from pruneops.onnx_utils import make_session
    from pruneops.quantizers import preprocess_for_quantization, quantize_static_qdq
    from pruneops.timing.sessions import measure_latencies

    sessions = {}
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            shape = [d if isinstance(d, int) else 64 for d in ort.InferenceSession(str(path)).get_inputs()[0].shape]
            x = np.random.default_rng(0).random(shape, dtype=np.float32)
            prepared = Path(tmp) / f"{path.stem}.prepared.onnx"
            preprocess_for_quantization(path, prepared)
            for form, exclude in (("static", []), ("static_fp32_stem", stem_convs(prepared))):
                out = Path(tmp) / f"{path.stem}.{form}.onnx"
                quantize_static_qdq(prepared, out, x, QuantizeConfig(), exclude)
                sessions[f"{path} {form}"] = make_session(out, 1)
            sessions[f"{path} fp32"] = make_session(path, 1)
        medians: dict[str, dict[int, float]] = {n: {} for n in sessions}
        for batch in (1, 64):
            timing = BenchmarkConfig(batch_sizes=[batch], warmup=5, repeats=40 if batch == 1 else 8, rounds=5)
            for name, per in measure_latencies(sessions, x, timing).items():
                medians[name][batch] = float(np.median(per[batch]))
    print(json.dumps(medians, indent=1))


if __name__ == "__main__":
    main([Path(p) for p in sys.argv[1:]])
