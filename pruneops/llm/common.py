"""What the decoder path's stages and `bench-decoder` share: artefact paths, cuts, exports, timing."""

from __future__ import annotations

import copy
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from pruneops.config.prune import DecoderMetric
from pruneops.io import Layout, read_json
from pruneops.models.decoders import save_causal_lm
from pruneops.planning.decoder import DecodeCostModel, DecoderShape, fit_cost_model, shape_of, width_step
from pruneops.pruning import decoder as cuts
from pruneops.timing.decode import GenerationTiming, build_genai_model, time_generation

CORPUS_FILE = "corpus.npz"  # validate's token blocks; its presence marks a causal-LM run
MODEL_DIR = "model"  # a HuggingFace folder (train, prune, finetune) or a genai folder (quantize, export)


def is_causal_lm_run(layout: Layout) -> bool:
    """Whether `validate` wrote a corpus (so every later stage takes the decoder path)."""
    return (layout.stage_dir("validate") / CORPUS_FILE).exists()


def load_blocks(layout: Layout) -> dict[str, np.ndarray]:
    """The corpus blocks `validate` wrote: train, val, test (int64, (n, block_length))."""
    with np.load(layout.stage_dir("validate") / CORPUS_FILE) as npz:
        return {name: npz[name].astype(np.int64) for name in ("train", "val", "test")}


def read_stage_json(layout: Layout, stage: str, name: str) -> dict:
    """A JSON file an earlier stage wrote under its artefacts."""
    return read_json(layout.stage_dir(stage) / name)


def cut_to_shape(
    dense: torch.nn.Module,
    shape: DecoderShape,
    calibration: cuts.Calibration | None,
    importance: str,
    reconstruct: bool,
    layer_order: list[int] | None = None,
) -> torch.nn.Module:
    """A copy of `dense` cut to `shape` (the dense model is left as it is)."""
    model = copy.deepcopy(dense)
    cuts.prune_to_shape_(
        model,
        shape.layers,
        shape.mlp_width,
        shape.kv_groups,
        shape.queries_per_group,
        calibration,
        importance,
        reconstruct,
        layer_order,
    )
    return model


def export_genai(model: torch.nn.Module, tokenizer: object, folder: Path, precisions: list[str], threads: int):
    """onnxruntime-genai folders of `model`, one per precision (`folder/<precision>`)."""
    hf = save_causal_lm(model, tokenizer, folder / "hf")
    out = {p: build_genai_model(hf, folder / p, p, threads) for p in precisions}
    shutil.rmtree(hf)  # the exported folders are what is timed and scored
    return out


def timing_shapes(base: DecoderShape, max_layers_dropped: int) -> list[DecoderShape]:
    """The uniform shapes a decode cost model is fitted on: dense, shallower, narrower, both, fewer KV groups."""
    step = width_step(base.mlp_width)
    half = max(step, base.mlp_width // 2 // step * step)
    deep = max(1, base.layers - max(max_layers_dropped, 2))
    grid = [base, replace(base, layers=deep), replace(base, mlp_width=half)]
    grid.append(replace(base, layers=deep, mlp_width=half))
    if base.kv_groups > 1:
        grid.append(replace(base, kv_groups=base.kv_groups - 1))
    return grid


def fit_costs(table: list[tuple[DecoderShape, GenerationTiming]]) -> dict[DecoderMetric, DecodeCostModel]:
    """The cost model of each latency metric (decode: ms per output token; prefill: ms to first token)."""
    metrics: tuple[DecoderMetric, ...] = ("decode", "prefill")
    return {m: fit_cost_model([(shape, timing.milliseconds(m)) for shape, timing in table]) for m in metrics}


def time_shapes(
    dense: torch.nn.Module,
    tokenizer: object,
    work: Path,
    *,
    max_layers_dropped: int,
    prompt_length: int,
    new_tokens: int,
    rounds: int,
    threads: int,
    seed: int,
) -> list[tuple[DecoderShape, GenerationTiming]]:
    """Times the timing shapes (fp32, batch 1, interleaved): dense first; `fit_costs` fits them.

    Which weights a shape keeps does not change its time, so the shapes are cut by magnitude, and
    layers from the end, without calibration.
    """
    base = shape_of(dense.config)
    grid = timing_shapes(base, max_layers_dropped)
    folders = {}
    for index, shape in enumerate(grid):
        model = (
            dense
            if shape == base
            else cut_to_shape(dense, shape, None, "magnitude", False, list(range(base.layers - 1, -1, -1)))
        )
        folders[f"shape{index}"] = export_genai(model, tokenizer, work / f"table{index}", ["fp32"], threads)["fp32"]
    prompt = np.random.default_rng(seed).integers(0, base.vocab, (1, prompt_length))
    timings = time_generation(folders, prompt, new_tokens, rounds)
    return [(shape, timings[f"shape{i}"]) for i, shape in enumerate(grid)]
