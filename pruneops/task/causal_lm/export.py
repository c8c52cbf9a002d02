"""`export` for a causal LM: the served folder, the dense references, greedy parity of the fp32 export."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pruneops.config import ExportConfig
from pruneops.core.errors import ParityError
from pruneops.core.io import Layout, dump_json, read_json, staged_output_paths
from pruneops.core.quality import ModelSource
from pruneops.models.decoders import load_causal_lm
from pruneops.modelstore.decoder import SERVED_FILE
from pruneops.pipeline.stages import StageReport
from pruneops.runtimes.base import Runtime
from pruneops.task.causal_lm.common import CHOICE_FILE, DECODER_RUNTIMES, MODEL_DIR, load_blocks

PARITY_PROMPT_TOKENS = 32  # the greedy parity check's prompt: the start of the first test block


@dataclass(frozen=True)
class DecoderExportReport(StageReport):
    """The served folder, the dense references and the greedy parity of the fp32 export."""

    precision: str
    greedy_tokens_checked: int
    greedy_tokens_equal: int
    tensorrt: str
    model_dir: Path
    runtime: str = "genai"

    def summary(self) -> str:
        return (
            f"{self.precision} {self.runtime} folder; fp32 greedy parity {self.greedy_tokens_equal}/"
            f"{self.greedy_tokens_checked} tokens -> {self.model_dir}"
        )


def _greedy_parity(model, runtime: Runtime, folder: Path, prompt: np.ndarray, tokens: int) -> int:
    """Generated tokens the exported model shares with torch's greedy output before the first difference."""
    ids = torch.as_tensor(prompt)
    expected = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
    )[:, ids.shape[1] :].numpy()
    exported = runtime.open(folder).greedy(prompt, tokens)
    differ = np.flatnonzero(exported[0] != expected[0])
    return int(differ[0]) if len(differ) else tokens


def export_decoder(config: ExportConfig, layout: Layout) -> DecoderExportReport:
    """Writes what ships, the references the benchmark times beside it, and checks the fp32 export's parity.

    `artifacts/export/model` is what `quantize` chose (the pruned model in its runtime and
    precision, or dense where the quality budget backed off); `dense/…` the adopted model in fp32,
    in the shipped runtime and precision, and in the fastest form within the budgets (what a user
    who never pruned would deploy, e.g. llama.cpp's Q4_K_M); `pruned/fp32` the recovered model in
    fp32 in the shipped runtime, which must generate `greedy_tokens` greedy tokens exactly as torch
    does. `manifest.json` lists them as every task's export does (`dense_fp32`, `dense_deployed`,
    `pruned_fp32`, `pruned_deployed`, and `dense_fastest` where it is none of those), each with its runtime.

    Raises:
        ParityError: The exported fp32 model's greedy output leaves torch's.
    """
    model, tokenizer = load_causal_lm(layout.stage_dir("finetune") / MODEL_DIR)
    choice = read_json(layout.stage_dir("quantize") / CHOICE_FILE)
    precision, source = choice["precision"], ModelSource.read(choice.get("source"))
    runtime = DECODER_RUNTIMES[choice["runtime"]]
    prompt = load_blocks(layout)["test"][:1, :PARITY_PROMPT_TOKENS].astype(np.int32)
    out = layout.stage_dir("export")
    with staged_output_paths(out, layout.metrics("export")) as staged:
        fp32 = runtime.export(model, staged.dir(out) / "pruned", ["fp32"], tokenizer=tokenizer)["fp32"]
        equal = _greedy_parity(model, runtime, fp32, prompt, config.greedy_tokens)
        if equal < config.greedy_tokens:
            raise ParityError(
                f"export: the fp32 export's greedy output leaves torch's after {equal} of {config.greedy_tokens} tokens"
            )
        quantized = layout.stage_dir("quantize")
        shutil.copytree(quantized / MODEL_DIR, staged.path(out) / MODEL_DIR)
        shutil.copytree(quantized / "dense", staged.path(out) / "dense")
        shutil.copy(layout.stage_dir("validate") / "prompt_reference.json", staged.path(out) / "prompt_reference.json")
        served = {"precision": precision, "vocabulary": choice["vocabulary"], "source": source,
                  "dense_ships": choice.get("dense_ships")}  # fmt: skip
        dump_json({**served, "runtime": runtime.name}, staged.path(out) / SERVED_FILE)
        models = _manifest_models(choice, served)
        manifest = {"runtime": runtime.name, "task": runtime.task, "models": models,
                    "fastest_dense": _fastest_row(choice, models)}  # fmt: skip
        dump_json(manifest, staged.path(out) / "manifest.json")
        report = DecoderExportReport(
            precision=precision,
            greedy_tokens_checked=config.greedy_tokens,
            greedy_tokens_equal=equal,
            tensorrt=f"not built: decoder LLMs are served by {runtime.name}",
            model_dir=out / MODEL_DIR,
            runtime=runtime.name,
        )
        dump_json(report.metrics(), staged.path(layout.metrics("export")))
    return report


def _manifest_models(choice: dict, served: dict) -> dict[str, dict]:
    """The export's rows: dense fp32, dense as deployed, pruned fp32, what ships, and the fastest dense form."""
    runtime, dense = choice["runtime"], choice["dense"]

    def row(role: str) -> dict:
        return {"file": dense[role]["file"], "precision": dense[role]["precision"], "runtime": dense[role]["runtime"]}

    models = {
        "dense_fp32": row("fp32"),
        "pruned_fp32": {"file": "pruned/fp32", "precision": "fp32", "runtime": runtime},
        "pruned_deployed": {"file": MODEL_DIR, **served, "runtime": runtime},
    }
    deployed = dense["deployed"]["candidate"]
    if deployed != dense["fp32"]["candidate"]:
        models["dense_deployed"] = row("deployed")
    if "fastest" in dense and dense["fastest"]["candidate"] not in {dense["fp32"]["candidate"], deployed}:
        models["dense_fastest"] = row("fastest")
    return models


def _fastest_row(choice: dict, models: dict[str, dict]) -> str | None:
    """The manifest row of the fastest dense form within the budgets (None: no dense form is within them)."""
    fastest = choice["dense"].get("fastest")
    if fastest is None:
        return None
    return next(n for n, m in models.items() if n.startswith("dense_") and m["file"] == fastest["file"])
