"""LoRA recovery against full recovery: tokens per second, what trains, and perplexity after the same budget.

Usage: `python studies/decoder/measure_recovery_lora.py --config studies/decoder-workload.yaml --width 704
--tokens 61440 --bf16 --runs full:3e-4 lora64:1e-3 lora16:1e-3`

Cuts the workload's dense model to `--width` MLP neurons per layer (activation importance,
least-squares reconstruction), then recovers one copy per run from the same seed with the bench
file's recovery settings for `--tokens` tokens: `full:LR` trains every weight, `loraR:LR` LoRA
adapters of rank R alone (alpha 2R), each at learning rate LR, in the bench file's compute dtype
(`--bf16` forces bf16). Prints, per run, wall time, tokens per second, trained parameters and
AdamW's state for them, and validation and test perplexity with paired 95 % intervals against
dense's.
"""

import argparse
import copy
import sys
from dataclasses import replace
from pathlib import Path

from measure_recovery_bf16 import mlp_cut_workload  # studies/ is on the path when a script runs

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # studies is not installed
from pruneops.models.language import paired_ratio_interval, perplexity
from pruneops.training.recovery import recover_
from studies.workload import recovery_settings


def _ratios(model, dense_scores: dict, data) -> str:
    parts = []
    for split in ("val", "test"):
        ratio, low, high = paired_ratio_interval(perplexity(model, getattr(data, split)), dense_scores[split])
        parts.append(f"{split} {ratio:.3f}x [{low:.3f}, {high:.3f}]")
    return ", ".join(parts)


def main() -> None:
    """Prints the cut model's perplexity ratios to dense, then each run's recovery."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a bench-decoder file")
    parser.add_argument("--width", type=int, required=True, help="MLP neurons kept per layer")
    parser.add_argument("--tokens", type=int, default=61440, help="recovery budget of each run")
    parser.add_argument("--runs", nargs="+", default=["full:3e-4", "lora64:1e-3"], help="full:LR or loraR:LR")
    parser.add_argument("--bf16", action="store_true", help="recover in bf16 whatever the bench file says")
    args = parser.parse_args()
    config, dense, data, shape, cut = mlp_cut_workload(args.config, args.width)
    dense_scores = {split: perplexity(dense, getattr(data, split)) for split in ("val", "test")}
    print(f"{shape.describe()} cut only: {_ratios(cut, dense_scores, data)} dense perplexity", flush=True)
    base = recovery_settings(config)
    base = replace(base, max_tokens=args.tokens, compute_dtype="bf16" if args.bf16 else base.compute_dtype)
    for run in args.runs:
        kind, lr = run.split(":")
        rank = int(kind[4:]) if kind.startswith("lora") else None
        settings = replace(base, lr=float(lr), lora_rank=rank, lora_alpha=2.0 * rank if rank else base.lora_alpha)
        model = copy.deepcopy(cut)
        result = recover_(model, dense, data.train, settings)
        spent = f"{result.tokens:,} tokens in {result.wall_s / 60:.1f} min ({result.tokens_per_second:.0f} tokens/s"
        state_mib = 2 * 4 * result.trained_parameters / 2**20  # AdamW: two fp32 moments per trained weight
        print(
            f"{run}: {spent}, {settings.compute_dtype}), {result.trained_parameters:,} trained parameters "
            f"(AdamW state {state_mib:.0f} MiB); {_ratios(model, dense_scores, data)} dense perplexity",
            flush=True,
        )


if __name__ == "__main__":
    main()
