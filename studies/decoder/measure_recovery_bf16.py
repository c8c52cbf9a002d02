"""Recovery in bf16 against fp32: tokens per second and validation perplexity after the same budget.

Usage: `python studies/decoder/measure_recovery_bf16.py --config studies/decoder-workload.yaml --width 512 \
        --tokens 40960`

Cuts the workload's dense model to `--width` MLP neurons per layer (activation importance,
least-squares reconstruction), then recovers two copies of it from the same seed with the bench
file's recovery settings for `--tokens` tokens: one with the forward passes under CPU bf16
autocast, one in fp32. Prints each one's wall time, tokens per second and validation perplexity.
"""

import argparse
import copy
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # studies is not installed
from pruneops.models.decoders import load_causal_lm
from pruneops.models.language import block_losses
from pruneops.planning.decode_cost import shape_of
from pruneops.pruning.decoder_cuts import calibrate
from pruneops.task.causal_lm.common import cut_to_shape
from pruneops.training.recovery import compute_dtype_warning, recover_
from studies.workload import load_bench_config, recovery_settings, workload_data


def mlp_cut_workload(config_path: str, width: int):
    """A bench file's workload with its dense model cut to `width` MLP neurons: (config, dense, data, shape, cut)."""
    config = load_bench_config(Path(config_path)).model_copy(update={"zero_shot": None, "out_of_domain": None})
    torch.set_num_threads(2)
    dense, tokenizer = load_causal_lm(config.model)
    data = workload_data(config, tokenizer)
    shape = replace(shape_of(dense.config), mlp_width=width)
    cut = cut_to_shape(dense, shape, calibrate(dense, data.calibration), "activation", True)
    return config, dense, data, shape, cut


def main() -> None:
    """Prints the cut model's validation perplexity, then each compute dtype's recovery."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a bench-decoder file")
    parser.add_argument("--width", type=int, required=True, help="MLP neurons kept per layer")
    parser.add_argument("--tokens", type=int, default=40960, help="recovery budget of each run")
    args = parser.parse_args()
    config, dense, data, shape, cut = mlp_cut_workload(args.config, args.width)
    dense_nll = float(block_losses(dense, data.val).mean())
    cut_ppl = np.exp(block_losses(cut, data.val).mean())
    print(f"dense val ppl {np.exp(dense_nll):.2f}; {shape.describe()} cut only {cut_ppl:.2f}")
    if warning := compute_dtype_warning("bf16"):
        print(warning)
    for dtype in ("bf16", "fp32"):
        model = copy.deepcopy(cut)
        settings = replace(recovery_settings(config), max_tokens=args.tokens, compute_dtype=dtype)
        result = recover_(model, dense, data.train, settings)
        nll = float(block_losses(model, data.val).mean())
        print(
            f"{dtype}: {result.tokens:,} tokens in {result.wall_s / 60:.1f} min ({result.tokens_per_second:.0f} "
            f"tokens/s), validation perplexity {np.exp(nll):.2f} ({np.exp(nll - dense_nll) - 1:+.1%} vs dense)"
        )


if __name__ == "__main__":
    main()
