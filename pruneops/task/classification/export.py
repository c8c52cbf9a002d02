"""`export` stage: the serving artifacts, parity-checked; TensorRT engines where possible."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pruneops.config import ExportConfig
from pruneops.core.errors import ParityError
from pruneops.core.inputs import as_tensors, rows, run_model
from pruneops.core.integrity import write_checksum
from pruneops.core.io import Layout, dump_json, read_json, staged_output_paths
from pruneops.core.plugins import Registry
from pruneops.core.quality import ModelSource
from pruneops.data import load_prepared
from pruneops.models.checkpoint import load_checkpoint
from pruneops.models.profiling import count_macs, count_nonzero_params, count_params
from pruneops.pipeline.stages import StageReport
from pruneops.runtimes.onnxruntime.files import export_onnx_file, make_session, ort_logits

EngineBuilder = Callable[[Path, Path, list[int]], dict]
ENGINE_BUILDERS: Registry[EngineBuilder] = Registry("engine builder")


def tensorrt_unavailable() -> str | None:
    """Why a TensorRT engine cannot be built here, or None when it can."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return "tensorrt is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


@ENGINE_BUILDERS.register("tensorrt", "TensorRT engine from the ONNX model (needs tensorrt + CUDA)")
def build_tensorrt_engine(onnx_path: Path, engine_path: Path, input_shape: list[int]) -> dict:
    """Builds an FP16-enabled TensorRT engine with a dynamic batch profile (1..64, opt 1)."""
    reason = tensorrt_unavailable()
    if reason:
        return {"status": "skipped", "reason": reason}
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        return {"status": "failed", "reason": f"ONNX parse: {errors}"}
    cfg = builder.create_builder_config()
    if builder.platform_has_fast_fp16:
        cfg.set_flag(trt.BuilderFlag.FP16)
    profile = builder.create_optimization_profile()
    name = network.get_input(0).name
    profile.set_shape(name, (1, *input_shape), (1, *input_shape), (64, *input_shape))
    cfg.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, cfg)
    if engine is None:
        return {"status": "failed", "reason": "engine build returned nothing"}
    engine_path.write_bytes(bytes(engine))
    return {"status": "built", "path": str(engine_path)}


@dataclass(frozen=True)
class ExportReport(StageReport):
    """Parity of each exported model and the TensorRT outcome."""

    dense_max_abs_diff: float
    pruned_max_abs_diff: float
    deployed_agreement: float
    deployed_precision: str
    tensorrt: str
    export_dir: Path

    def summary(self) -> str:
        return (
            f"parity dense {self.dense_max_abs_diff:.1e}, pruned {self.pruned_max_abs_diff:.1e}, "
            f"deployed ({self.deployed_precision}) top-1 agreement {100 * self.deployed_agreement:.1f}%; "
            f"tensorrt: {self.tensorrt} -> {self.export_dir}"
        )


def check_parity(
    model: torch.nn.Module, onnx_path: Path, x: np.ndarray | dict[str, np.ndarray], atol: float, label: str
) -> float:
    """Largest |PyTorch - ONNX Runtime| logit difference over `x`.

    Raises:
        ParityError: Beyond `atol`.
    """
    with torch.no_grad():
        ref = run_model(model, as_tensors(x)).numpy()
    diff = float(np.abs(ort_logits(make_session(onnx_path), x) - ref).max())
    if diff > atol:
        raise ParityError(f"{label}: ONNX Runtime differs from PyTorch by {diff:.2e} > export.parity_atol={atol:g}")
    return diff


def export_onnx(config: ExportConfig, layout: Layout | None = None) -> ExportReport:
    """Exports the dense and pruned models to ONNX and checks them against PyTorch.

    Both get a dynamic batch axis; the model `quantize` chose ships beside them (`pruned_deployed`:
    the pruned model in its form, or dense where it backed off), with dense in the same form where
    that is not fp32 (`dense_deployed`) and dense's fastest form within the budget where it is neither
    (`dense_fastest`; the manifest's `fastest_dense` names its row), and TensorRT engines are built
    where tensorrt and a CUDA device are present.

    Returns:
        The report; `artifacts/export/` holds the models and `manifest.json` describing them.

    Raises:
        ParityError: An fp32 export disagrees with PyTorch beyond `parity_atol`.
    """
    layout = layout or Layout()
    meta, _, val, _ = load_prepared(layout.stage_dir("validate"))
    x = rows(val.x, slice(0, config.parity_samples))
    sources = {
        "dense_fp32": load_checkpoint(layout.stage_dir("train") / "model.safetensors"),
        "pruned_fp32": load_checkpoint(layout.stage_dir("finetune") / "model.safetensors"),
    }
    deployed_src = layout.stage_dir("quantize") / "model.onnx"
    quantized = read_json(layout.stage_dir("quantize") / "quantize.json")
    out_dir, metrics_path = layout.stage_dir("export"), layout.metrics("export")
    with staged_output_paths(out_dir, metrics_path) as staged:
        tmp = staged.dir(out_dir)
        manifest: dict[str, dict] = {}
        diffs = {}
        for name, ckpt in sources.items():
            path = tmp / f"{name}.onnx"
            export_onnx_file(ckpt.model, meta.input_shape, path, config.opset, config.exporter)
            diffs[name] = check_parity(ckpt.model, path, x, config.parity_atol, name)
            manifest[name] = {
                "file": path.name,
                "precision": "fp32",
                "params": count_params(ckpt.model),
                "nonzero_params": count_nonzero_params(ckpt.model),
                "macs": count_macs(ckpt.model, meta.input_shape),
                "max_abs_diff": diffs[name],
            }
        # What ships: the pruned model in the form quantize chose, or dense where no pruned form was
        # within the quality budget (`source`); and dense in that form, the row of the same precision.
        source = ModelSource.read(quantized.get("source"))
        shutil.copyfile(deployed_src, tmp / "pruned_deployed.onnx")
        fp32_pred = ort_logits(make_session(tmp / f"{source}_fp32.onnx"), x).argmax(1)
        deployed_pred = ort_logits(make_session(tmp / "pruned_deployed.onnx"), x).argmax(1)
        agreement = float((fp32_pred == deployed_pred).mean())
        deployed = {"precision": quantized["precision"], "quantizer": quantized["method"]}
        manifest["pruned_deployed"] = {
            **manifest[f"{source}_fp32"],
            "file": "pruned_deployed.onnx",
            **deployed,
            "source": source,
            "dense_ships": quantized.get("dense_ships"),
            "top1_agreement_with_fp32": agreement,
        }
        manifest["pruned_deployed"].pop("max_abs_diff")
        fastest = _dense_rows(layout.stage_dir("quantize"), quantized, manifest, tmp)
        trt = {}
        if config.tensorrt:
            for name in ("dense_fp32", "pruned_fp32"):
                trt[name] = ENGINE_BUILDERS.get("tensorrt")(
                    tmp / f"{name}.onnx", tmp / f"{name}.engine", meta.input_shape
                )
        else:
            trt = {"all": {"status": "skipped", "reason": "disabled by export.tensorrt: false"}}
        for entry in manifest.values():  # what benchmark, publish and serving check before trusting a file
            entry["sha256"] = write_checksum(tmp / entry["file"])
        first = next(iter(trt.values()))
        trt_line = "built" if first["status"] == "built" else f"{first['status']} — {first.get('reason', '')}"
        dump_json(
            {
                "input_shape": meta.input_shape,
                "num_classes": meta.num_classes,
                "models": manifest,
                "tensorrt": trt,
                "fastest_dense": fastest,
            },
            tmp / "manifest.json",
        )
        report = ExportReport(
            diffs["dense_fp32"], diffs["pruned_fp32"], agreement, quantized["precision"], trt_line, out_dir
        )
        dump_json(report.metrics(), staged.path(metrics_path))
    return report


def _dense_rows(quantize_dir: Path, quantized: dict, manifest: dict[str, dict], tmp: Path) -> str | None:
    """Adds dense as deployed and dense's fastest form to `manifest`; the row of the fastest (None: none within).

    Dense as deployed (`dense.onnx`: dense in the form that ships) where that is not fp32; dense's
    fastest form within the budget (`dense_fastest.onnx`) where it is neither of those.
    """
    method, fastest = quantized["method"], quantized.get("fastest_dense")

    def row(name: str, src: str, quantizer: str, precision: str) -> None:
        shutil.copyfile(quantize_dir / src, tmp / f"{name}.onnx")
        manifest[name] = {**manifest["dense_fp32"], "file": f"{name}.onnx", "precision": precision,
                          "quantizer": quantizer}  # fmt: skip
        manifest[name].pop("max_abs_diff")

    if quantized["precision"] != "fp32":
        row("dense_deployed", "dense.onnx", method, quantized["precision"])
    if fastest is None or fastest == "fp32":
        return None if fastest is None else "dense_fp32"
    if fastest == method:
        return "dense_deployed"
    row("dense_fastest", "dense_fastest.onnx", fastest, quantized["dense_candidates"][fastest]["precision"])
    return "dense_fastest"
