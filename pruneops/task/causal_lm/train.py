"""`train` for a causal LM: the user's pretrained decoder adopted as it is, scored and saved as a plain folder."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pruneops.config import ExportConfig, TrainConfig
from pruneops.core.io import Layout, dump_json, staged_output_paths
from pruneops.models.decoder_layout import layout_of
from pruneops.models.decoders import load_causal_lm, save_causal_lm
from pruneops.models.language import block_losses, perplexity_from_losses
from pruneops.pipeline.stages import StageReport
from pruneops.planning.decode_cost import shape_of
from pruneops.reports.decoder_plots import plot_note
from pruneops.task.causal_lm.common import MODEL_DIR, RUNTIMES_FILE, load_blocks, resolve_runtimes


@dataclass(frozen=True)
class AdoptedDecoderReport(StageReport):
    """The adopted causal LM's shape and validation perplexity."""

    model: str
    params: int
    layers: int
    mlp_width: int
    kv_groups: int
    cuts: str  # what decoder pruning can cut in this model, and what its config cannot express
    runtimes: str  # the runtimes that serve it here (`export.runtime`), and why any other cannot
    val_perplexity: float
    val_perplexity_ci: list
    checkpoint: Path

    def summary(self) -> str:
        return (
            f"{self.model}: {self.params:,} params, {self.layers} layers, validation perplexity "
            f"{self.val_perplexity:.2f} -> {self.checkpoint}\n{self.cuts}\n{self.runtimes}"
        )


def adopt_causal_lm(config: TrainConfig, export: ExportConfig, layout: Layout) -> AdoptedDecoderReport:
    """Loads the user's decoder (folder or GGUF) as it is, scores it, and saves a plain folder.

    Resolves which runtimes serve it here (`export.runtime`: each asked is probed with a small copy
    of the family) once for every later stage. Writes `artifacts/train/model/` (safetensors,
    config, tokenizer: what every runtime loads) and `runtimes.json`.

    Raises:
        ConfigError: The model has what decoder pruning cannot handle (named), or no runtime asked
            can serve its family here (each one's reason), before it is scored.
    """
    torch.set_num_threads(config.threads)
    model, tokenizer = load_causal_lm(config.pretrained)
    cuts = layout_of(model).describe()  # the first stage that loads the model refuses what cannot be cut
    runtimes = resolve_runtimes(export.runtime, model, tokenizer)  # and a family no runtime asked can serve
    losses = block_losses(model, load_blocks(layout)["val"])
    ppl = perplexity_from_losses(losses, 0)
    shape = shape_of(model.config)
    out = layout.stage_dir("train")
    plots = layout.plots("train")
    with staged_output_paths(out, layout.metrics("train"), plots) as staged:
        save_causal_lm(model, tokenizer, staged.path(out) / MODEL_DIR)
        dump_json(asdict(runtimes), staged.path(out) / RUNTIMES_FILE)
        report = AdoptedDecoderReport(
            model=str(config.pretrained),
            params=sum(p.numel() for p in model.parameters()),
            layers=shape.layers,
            mlp_width=shape.mlp_width,
            kv_groups=shape.kv_groups,
            cuts=cuts,
            runtimes=runtimes.describe(),
            val_perplexity=ppl.value,
            val_perplexity_ci=[ppl.low, ppl.high],
            checkpoint=out / MODEL_DIR,
        )
        dump_json(report.metrics(), staged.path(layout.metrics("train")))
        dump_json([], staged.path(plots) / "history.json")
        plot_note("adopted as it is (epochs: 0): no training history", staged.path(plots) / "history.png")
    return report
