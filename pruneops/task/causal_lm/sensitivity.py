"""`sensitivity` for a causal LM: the perplexity each decoder layer's removal adds alone."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from pruneops.config import ComputeConfig, SensitivityConfig
from pruneops.core.io import Layout, dump_json, staged_output_paths
from pruneops.models.decoders import load_causal_lm, remove_layers_
from pruneops.models.language import block_losses
from pruneops.pipeline.compute import open_backend
from pruneops.pipeline.stages import StageReport
from pruneops.planning.decode_cost import shape_of
from pruneops.pruning.decoder_cuts import calibrate
from pruneops.reports.decoder_plots import plot_layer_sensitivity
from pruneops.task.causal_lm.common import MODEL_DIR, load_blocks


@dataclass(frozen=True)
class LayerSensitivityReport(StageReport):
    """Each decoder layer's cost when removed alone."""

    layers: int
    blocks_scored: int
    dense_perplexity: float
    least_harmful: list
    layer_order: list

    def summary(self) -> str:
        return (
            f"{self.layers} layers each removed alone on {self.blocks_scored} validation blocks; "
            f"least harmful first: {self.layer_order[:6]}"
        )


def _loss_without_layer(model: torch.nn.Module, val: np.ndarray, layer: int) -> float:
    """Mean validation loss of a copy of `model` with `layer` removed."""
    cut = copy.deepcopy(model)
    remove_layers_(cut, [layer])
    return float(block_losses(cut, val).mean())


def layer_sensitivity(
    config: SensitivityConfig, layout: Layout, compute: ComputeConfig | None = None
) -> LayerSensitivityReport:
    """Validation perplexity added by removing each decoder layer alone, beside its block influence.

    `val_blocks` caps the validation blocks scored (null: all). The layers' evaluations are
    independent: the `compute` backend runs them (the same values wherever). Writes the ranking
    prune drops whole layers in (`artifacts/sensitivity/layers.json`), curves and a plot.
    """
    torch.set_num_threads(config.threads)
    model, _ = load_causal_lm(layout.stage_dir("train") / MODEL_DIR)
    blocks = load_blocks(layout)
    val = blocks["val"][: config.val_blocks] if config.val_blocks else blocks["val"]
    influence = calibrate(model, torch.as_tensor(blocks["train"][:8]), attention=False).block_influence
    dense = float(block_losses(model, val).mean())
    layers = [(layer,) for layer in range(shape_of(model.config).layers)]
    with open_backend(compute, layout.root, config.threads) as backend:
        losses = backend.map(_loss_without_layer, layers, (model, val), "sensitivity (layers)")
    rows = [
        {
            "layer": layer,
            "ratio": 1.0,
            "perplexity_increase": float(np.exp(loss - dense)) - 1.0,
            "block_influence": influence[layer],
        }
        for (layer,), loss in zip(layers, losses, strict=True)
    ]
    order = sorted(range(len(rows)), key=lambda i: rows[i]["perplexity_increase"])
    out, plots = layout.stage_dir("sensitivity"), layout.plots("sensitivity")
    with staged_output_paths(out, layout.metrics("sensitivity"), plots) as staged:
        staged.path(out).mkdir(parents=True)
        dump_json({"layer_order": order, "layers": rows}, staged.path(out) / "layers.json")
        dump_json(rows, staged.path(plots) / "curves.json")
        plot_layer_sensitivity(rows, staged.path(plots) / "sensitivity.png")
        report = LayerSensitivityReport(
            layers=len(rows),
            blocks_scored=len(val),
            dense_perplexity=float(np.exp(dense)),
            least_harmful=[rows[i]["perplexity_increase"] for i in order[:3]],
            layer_order=order,
        )
        dump_json(report.metrics(), staged.path(layout.metrics("sensitivity")))
    return report
