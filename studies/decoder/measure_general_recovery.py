"""Whether recovery can keep a cut decoder general: today's recipe against self-written text, same plan.

Usage: `python studies/decoder/measure_general_recovery.py --project PROJECT --model assets/llm/smollm2-135m
--tokens 60000 --recipes corpus self:0.5 distill`

Reads a decoder project's blocks (`artifacts/validate/corpus.npz`: train, val, test and the general
text's blocks) and the plan its prune stage kept (`plan.json`: shape and the layers removed), cuts
the dense model to that plan as the prune stage does (activation importance, least-squares
reconstruction, 32 calibration blocks), and recovers a copy of the cut model with each recipe for
the same number of tokens (the same shape: the same decode time):

- `corpus`: the pipeline's default recipe (`finetune`: half KL to the dense model, half next-token
  loss on the corpus's training blocks);
- `self:F`: the same, a fraction F of the blocks written by the dense model itself
  (`finetune.self_text_fraction: F`, what the finetune stage mixes in);
- `distill`: KL to the dense model alone, on the corpus.

Prints validation, test and general-text perplexity of the cut model and of each recovered one
against dense (torch fp32, paired 95 % bootstrap interval over blocks) and writes them to `--out`.

`--mlp-widths W ...` replaces the kept plan by milder cuts: every layer kept, the MLP cut to each
width in turn (the same cut and calibration), each scored and recovered with each recipe. What the
general-text budget leaves a pruned model: the widest cut whose general text holds it.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # studies is not installed
from pruneops.config import FinetuneConfig
from pruneops.models.decoders import load_causal_lm
from pruneops.models.language import (
    block_losses,
    calibration_blocks,
    paired_ratio_interval,
    perplexity_from_losses,
)
from pruneops.planning.decode_cost import DecoderShape, shape_of
from pruneops.pruning.decoder_cuts import calibrate
from pruneops.task.causal_lm.common import cut_to_shape
from pruneops.task.causal_lm.finetune import _with_self_text
from pruneops.training.recovery import RecoverySettings, recover_

SPLITS = ("val", "test", "general")


def _scores(model: torch.nn.Module, blocks: dict[str, np.ndarray], dense: dict[str, np.ndarray]) -> dict:
    out = {}
    for split in SPLITS:
        losses = block_losses(model, blocks[split])
        ppl = perplexity_from_losses(losses, 0)
        ratio, low, high = paired_ratio_interval(ppl, perplexity_from_losses(dense[split], 0))
        out[split] = {"perplexity": ppl.value, "ratio": ratio, "low": low, "high": high}
    return out


def _line(name: str, scores: dict) -> str:
    def pct(x: float) -> str:
        return f"{100 * (x - 1):+.1f}"

    cells = [
        f"{row['perplexity']:.2f} ({pct(row['ratio'])} % [{pct(row['low'])}, {pct(row['high'])}])"
        for row in scores.values()
    ]
    return f"| {name} | " + " | ".join(cells) + " |"


def _recipe(name: str, tokens: int, dtype: str, batch: int) -> tuple[FinetuneConfig, RecoverySettings]:
    """The pipeline's recovery settings (`examples/causal-lm/params.yaml`), the recipe's data and loss."""
    fraction = float(name.split(":")[1]) if name.startswith("self:") else 0.0
    weight = 1.0 if name == "distill" else 0.5
    config = FinetuneConfig(
        max_tokens=tokens,
        self_text_fraction=fraction,
        distill_weight=weight,
        batch_size=batch,  # FitParams' default (64, a classifier's) would hold 64 blocks' logits at once
        lr=3e-4,
        distill_temperature=1.0,
    )
    settings = RecoverySettings(
        max_tokens=tokens,
        batch_blocks=config.batch_size,
        lr=config.lr,
        temperature=config.distill_temperature,
        distill_weight=weight,
        weight_decay=0.0,
        seed=0,
        compute_dtype=dtype,
        device="cpu",
    )
    return config, settings


CALIBRATION_SELF_FRACTION = {"corpus": 0.0, "self": 1.0, "mixed": 0.5}  # `prune.decoder.calibration_self_fraction`


def main() -> None:
    """Prints the table and writes `--out`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", required=True, help="a decoder project whose validate and prune ran")
    parser.add_argument("--model", required=True, help="the dense model (folder or .gguf)")
    parser.add_argument("--tokens", type=int, default=60_000)
    parser.add_argument("--recipes", nargs="*", default=["corpus", "self:0.5", "distill"])
    parser.add_argument("--compute-dtype", default="bf16", choices=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4, help="blocks per step (the example params' 4)")
    parser.add_argument("--out", default="studies/decoder/general_recovery.json")
    parser.add_argument("--mlp-widths", type=int, nargs="*", default=[], help="cut the MLP alone to each width")
    parser.add_argument(
        "--calibration",
        default="corpus",
        choices=list(CALIBRATION_SELF_FRACTION),
        help="the 32 blocks the cut is calibrated on: the corpus's (the prune stage's), the dense model's own "
        "writing after each block's first tokens, or half of each",
    )
    args = parser.parse_args()
    project = Path(args.project)
    torch.set_num_threads(args.threads)
    with np.load(project / "artifacts/validate/corpus.npz") as npz:
        blocks = {name: npz[name].astype(np.int64) for name in npz.files}
    dense, _ = load_causal_lm(Path(args.model))
    dense.eval()
    if args.mlp_widths:
        full = shape_of(dense.config)
        shapes = [dataclasses.asdict(dataclasses.replace(full, mlp_width=w)) for w in args.mlp_widths]
        plans = [({"shape": shape, "layers_removed": []}, f"MLP {shape['mlp_width']}, ") for shape in shapes]
    else:
        plans = [(json.loads((project / "plan.json").read_text()), "")]
    if args.calibration != "corpus":
        plans = [(plan, f"{label}calibrated on {args.calibration} text, ") for plan, label in plans]
    dense_losses = {split: block_losses(dense, blocks[split]) for split in SPLITS}
    own = CALIBRATION_SELF_FRACTION[args.calibration]
    calibration = calibrate(dense, torch.as_tensor(calibration_blocks(dense, blocks["train"], 32, own, seed=0)))
    rows, walls = {}, {}

    def write() -> None:  # after each recipe: a run cut short keeps what it measured
        record = {
            "rows": rows,
            "runs": walls,
            "plans": [plan for plan, _ in plans],
            "args": vars(args),
            "machine": {"cpu": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d")},
        }
        Path(args.out).write_text(json.dumps(record, indent=1))

    print("| model | validation | test | general text |\n|---|---|---|---|")
    for plan, label in plans:
        shape = DecoderShape(**plan["shape"])
        removed = list(plan["layers_removed"])
        order = removed + [i for i in range(dense.config.num_hidden_layers) if i not in removed]
        cut = cut_to_shape(dense, shape, calibration, "activation", True, order)
        rows[f"{label}cut, not recovered"] = _scores(cut, blocks, dense_losses)
        print(_line(f"{label}cut, not recovered", rows[f"{label}cut, not recovered"]), flush=True)
        write()
        cut_state = {name: tensor.clone() for name, tensor in cut.state_dict().items()}  # each recipe starts from it
        gc.collect()
        for name in args.recipes:
            config, settings = _recipe(name, args.tokens, args.compute_dtype, args.batch_size)
            model = cut
            model.load_state_dict(cut_state)
            start = time.perf_counter()
            train, written = _with_self_text(dense, blocks["train"], config)
            recover_(model, dense, train, settings)
            walls[f"{label}{name}"] = {"wall_s": time.perf_counter() - start, "written_blocks": written}
            model.eval()
            rows[f"{label}{name}"] = _scores(model, blocks, dense_losses)
            minutes = walls[f"{label}{name}"]["wall_s"] / 60
            print(
                _line(f"{label}{name} ({args.tokens:,} tokens, {minutes:.1f} min)", rows[f"{label}{name}"]), flush=True
            )
            write()
            del train
            gc.collect()


if __name__ == "__main__":
    main()
