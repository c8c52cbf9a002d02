"""The decoder path of `validate`, `train` and `sensitivity`: corpus blocks, the adopted model, layers."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pruneops.config import ComputeConfig, SensitivityConfig, TrainConfig, ValidateConfig
from pruneops.core.io import Layout, dump_json, staged_output_paths
from pruneops.data.corpus import read_documents, split_documents, to_blocks
from pruneops.data.drift import prompt_reference
from pruneops.data.expectations import raise_if_failed, run_corpus_suite
from pruneops.data.text import text_digests
from pruneops.models.decoders import load_causal_lm, load_causal_tokenizer, remove_layers_, save_causal_lm
from pruneops.models.language import block_losses, perplexity_from_losses
from pruneops.pipeline.compute import open_backend
from pruneops.pipeline.stages import StageReport
from pruneops.planning.decode_cost import shape_of
from pruneops.pruning.decoder_cuts import calibrate
from pruneops.reports.decoder_plots import plot_layer_sensitivity, plot_note
from pruneops.task.causal_lm.common import CORPUS_FILE, MODEL_DIR, load_blocks

REFERENCE_FILE = "prompt_reference.json"  # the token-frequency reference of prompt drift


@dataclass(frozen=True)
class CorpusReport(StageReport):
    """What `validate` found in a corpus and wrote."""

    dataset: str
    documents: dict
    tokens: dict
    blocks: dict
    block_length: int
    duplicates_dropped: int
    expectations_evaluated: int
    expectations_failed: int
    data_dir: Path

    def summary(self) -> str:
        b = self.blocks
        return (
            f"corpus: {b['train']}/{b['val']}/{b['test']} blocks of {self.block_length} tokens (train/val/test), "
            f"{self.expectations_evaluated} expectations passed -> {self.data_dir}"
        )


def _drop_repeats(documents: list[str]) -> tuple[list[str], int]:
    digests = text_digests(documents)
    seen: set[str] = set()
    kept = []
    for document, digest in zip(documents, digests, strict=True):
        if digest not in seen:
            seen.add(digest)
            kept.append(document)
    return kept, len(documents) - len(kept)


def validate_corpus(config: ValidateConfig, layout: Layout) -> CorpusReport:
    """Reads, splits by document, checks (Great Expectations) and blocks a causal LM's corpus.

    Writes `artifacts/validate/corpus.npz` (train/val/test token blocks, the model's own tokenizer),
    the prompt-drift reference (the most frequent training tokens and their shares) and a summary.

    Raises:
        DataError: The file cannot be read, or too few documents to split.
        DataValidationError: An expectation failed (nothing is written).
    """
    documents = read_documents(config.path, config.text_column, config.encoding)
    dropped = 0
    if config.drop_duplicates:
        documents, dropped = _drop_repeats(documents)
    splits = split_documents(documents, config.val_fraction, config.test_fraction, config.seed)
    tokenizer = load_causal_tokenizer(config.tokenizer)
    blocks, tokens = {}, {}
    for name, docs in splits.items():
        blocks[name], tokens[name] = to_blocks(docs, tokenizer, config.block_length)
    suite = run_corpus_suite(
        splits=splits,
        blocks=blocks,
        text_length=(config.min_text_chars, config.max_text_chars),
        max_duplicate_fraction=config.max_duplicate_fraction,
        max_leakage_fraction=config.max_leakage_fraction,
        unknown_id=getattr(tokenizer, "unk_token_id", None),
        max_unknown_token_rate=config.max_unknown_token_rate,
    )
    raise_if_failed(suite)
    out = layout.stage_dir("validate")
    with staged_output_paths(out, layout.metrics("validate")) as staged:
        folder = staged.path(out)
        folder.mkdir(parents=True)
        np.savez_compressed(folder / CORPUS_FILE, **{k: v.astype(np.int32) for k, v in blocks.items()})
        dump_json(prompt_reference([b.tolist() for b in blocks["train"]]), folder / REFERENCE_FILE)
        report = CorpusReport(
            dataset=config.dataset,
            documents={k: len(v) for k, v in splits.items()},
            tokens=tokens,
            blocks={k: len(v) for k, v in blocks.items()},
            block_length=config.block_length,
            duplicates_dropped=dropped,
            expectations_evaluated=len(suite.outcomes),
            expectations_failed=len(suite.failed),
            data_dir=out,
        )
        dump_json(report.metrics(), staged.path(layout.metrics("validate")))
    return report


@dataclass(frozen=True)
class AdoptedDecoderReport(StageReport):
    """The adopted causal LM's shape and validation perplexity."""

    model: str
    params: int
    layers: int
    mlp_width: int
    kv_groups: int
    val_perplexity: float
    val_perplexity_ci: list
    checkpoint: Path

    def summary(self) -> str:
        return (
            f"{self.model}: {self.params:,} params, {self.layers} layers, validation perplexity "
            f"{self.val_perplexity:.2f} -> {self.checkpoint}"
        )


def adopt_causal_lm(config: TrainConfig, layout: Layout) -> AdoptedDecoderReport:
    """Loads the user's decoder (folder or GGUF) as it is, scores it, and saves a plain folder.

    Writes `artifacts/train/model/` (safetensors, config, tokenizer: what every runtime loads).
    """
    torch.set_num_threads(config.threads)
    model, tokenizer = load_causal_lm(config.pretrained)
    losses = block_losses(model, load_blocks(layout)["val"])
    ppl = perplexity_from_losses(losses, 0)
    shape = shape_of(model.config)
    out = layout.stage_dir("train")
    plots = layout.plots("train")
    with staged_output_paths(out, layout.metrics("train"), plots) as staged:
        save_causal_lm(model, tokenizer, staged.path(out) / MODEL_DIR)
        report = AdoptedDecoderReport(
            model=str(config.pretrained),
            params=sum(p.numel() for p in model.parameters()),
            layers=shape.layers,
            mlp_width=shape.mlp_width,
            kv_groups=shape.kv_groups,
            val_perplexity=ppl.value,
            val_perplexity_ci=[ppl.low, ppl.high],
            checkpoint=out / MODEL_DIR,
        )
        dump_json(report.metrics(), staged.path(layout.metrics("train")))
        dump_json([], staged.path(plots) / "history.json")
        plot_note("adopted as it is (epochs: 0): no training history", staged.path(plots) / "history.png")
    return report


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
