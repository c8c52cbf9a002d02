"""How much a token budget of distillation recovers of a cut decoder's perplexity, on this machine.

Usage: `python studies/decoder/measure_decoder_recovery.py --results docs/results/llm/smollm2-speeches/results.json
--target 0.7 --tokens 4000 8000 12000`

Reads the bench-decoder report's workload (model, corpus, seeds, block counts) and the plan it
kept for `--target`, cuts the dense model to that plan the same way (activation importance,
least-squares reconstruction), then trains it on training blocks (`--distill-weight` x KL from
the dense model + the rest x next-token loss) and prints, at each budget in `--tokens` (points of
one run whose warm-up and cosine decay span the largest budget), the validation, test and
out-of-domain perplexity (torch, the report's blocks) against dense, with the paired 95 %
interval over blocks, and the wall time.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from pruneops.task.causal_lm.common import cut_to_shape

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # studies is not installed
from pruneops.models.decoders import load_causal_lm
from pruneops.models.language import block_losses, paired_ratio_interval, perplexity_from_losses
from pruneops.planning.decode_cost import DecoderShape
from pruneops.pruning.decoder_cuts import calibrate
from pruneops.training.recovery import RecoverySettings, recover_
from studies.workload import DecoderBenchConfig, workload_data


def _ratio(losses, dense) -> str:
    ratio, low, high = paired_ratio_interval(perplexity_from_losses(losses, 0), perplexity_from_losses(dense, 0))
    value = perplexity_from_losses(losses, 0).value
    return f"{value:.2f} ({100 * (ratio - 1):+.1f} % [{100 * (low - 1):+.1f}, {100 * (high - 1):+.1f}])"


def main() -> None:
    """Prints the recovery curve."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", required=True, help="a bench-decoder results.json")
    parser.add_argument("--target", type=float, required=True, help="the target whose kept plan is cut")
    parser.add_argument("--tokens", type=int, nargs="+", required=True, help="cumulative budgets to report at")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch-blocks", type=int, default=4)
    parser.add_argument("--distill-weight", type=float, default=1.0, help="KL weight; the rest is next-token loss")
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    results = json.loads(Path(args.results).read_text())
    config = DecoderBenchConfig.model_validate(results["config"])
    row = next(
        r for r in results["rows"] if r["kind"] == "ours" and r["target"] == args.target and r["precision"] == "fp32"
    )
    shape = DecoderShape(**row["shape"])
    torch.set_num_threads(2)
    dense, tokenizer = load_causal_lm(config.model)
    data = workload_data(config, tokenizer)
    model = cut_to_shape(dense, shape, calibrate(dense, data.calibration), "activation", True)
    splits = ("val", "test", "ood") if data.ood is not None else ("val", "test")
    reference = {name: block_losses(dense, getattr(data, name)) for name in splits}
    print(
        f"plan {shape.describe()}; dense val {perplexity_from_losses(reference['val'], 0).value:.2f}, "
        f"test {perplexity_from_losses(reference['test'], 0).value:.2f}"
    )
    marks = sorted(args.tokens)
    clock = {"start": time.perf_counter(), "evaluating": 0.0}

    def report(used: int) -> None:
        begun = time.perf_counter()
        losses = {name: block_losses(model, getattr(data, name)) for name in splits}
        training = begun - clock["start"] - clock["evaluating"]
        figures = ", ".join(f"{name} {_ratio(losses[name], reference[name])}" for name in splits)
        print(f"{used:>7,} tokens, {training / 60:5.1f} min training: {figures}", flush=True)
        clock["evaluating"] += time.perf_counter() - begun

    report(0)

    def progress(used: int, loss: float) -> None:
        while marks and used >= marks[0]:
            marks.pop(0)
            model.eval()
            report(used)
            model.train()

    settings = RecoverySettings(
        max_tokens=max(args.tokens),
        batch_blocks=args.batch_blocks,
        lr=args.lr,
        temperature=args.temperature,
        distill_weight=args.distill_weight,
        seed=config.seed,
    )
    recover_(model, dense, data.train, settings, progress)


if __name__ == "__main__":
    main()
