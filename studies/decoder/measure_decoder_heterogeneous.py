"""Whether per-layer MLP widths beat one uniform width at the same weights, on a bench-decoder workload.

Usage: `python studies/decoder/measure_decoder_heterogeneous.py --results docs/results/llm/smollm2-speeches/results.json
--width 768`

Both cuts keep the same number of MLP neurons in all (so the same layer weights, which is what the
decode cost model says time per token follows), ranked by activation importance from one
calibration pass, with least-squares reconstruction of each down projection. Uniform keeps
`--width` per layer; heterogeneous ranks every neuron of every layer together by its score
standardised within its layer (FLAP's global allocation) and rounds each layer's count to a
multiple of 64. Prints each layer's width and the validation and test perplexity of heterogeneous
against uniform with the paired 95 % interval over blocks. onnxruntime-genai's builder reads one
MLP width from the config, so the heterogeneous model cannot be exported or timed through it.
"""

import argparse
import copy
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # studies is not installed
from pruneops.models.decoder_layout import layout_of, weight_out_in
from pruneops.models.decoders import keep_inputs_, keep_outputs_, load_causal_lm
from pruneops.models.language import block_losses, paired_ratio_interval, perplexity_from_losses
from pruneops.planning.decode_cost import shape_of
from pruneops.pruning.decoder_cuts import NEURON_IMPORTANCES, calibrate, least_squares_
from pruneops.task.causal_lm.common import cut_to_shape
from studies.workload import DecoderBenchConfig, workload_data

STEP = 64


def _scores(model, calibration) -> list[torch.Tensor]:
    layout, score = layout_of(model), NEURON_IMPORTANCES.get("activation")
    out = []
    for index, layer in enumerate(layout.decoder_layers(model)):
        inputs, down = layout.mlp_modules(layer)
        out.append(score([weight_out_in(m) for m in inputs], weight_out_in(down), calibration.mlp[index]))
    return out


def _widths(scores: list[torch.Tensor], total: int) -> list[int]:
    """Per-layer counts from a global ranking of within-layer standardised scores, multiples of STEP."""
    z = torch.cat([(s - s.mean()) / s.std() for s in scores])
    threshold = z.topk(total).values.min()
    raw = [int(((s - s.mean()) / s.std() >= threshold).sum()) for s in scores]
    widths = [max(STEP, round(r / STEP) * STEP) for r in raw]
    order = sorted(range(len(widths)), key=lambda i: raw[i] - widths[i])  # most rounded up first
    while sum(widths) > total:
        i = next(i for i in order if widths[i] > STEP)
        widths[i] -= STEP
        order.append(order.pop(order.index(i)))
    while sum(widths) < total:
        i = order[-1]
        widths[i] += STEP
        order.insert(0, order.pop())
    return widths


def _cut_per_layer(dense, calibration, scores, widths):
    model = copy.deepcopy(dense)
    layout = layout_of(model)
    for index, layer in enumerate(layout.decoder_layers(model)):
        inputs, down = layout.mlp_modules(layer)
        keep = scores[index].topk(widths[index]).indices.sort().values
        least_squares_(down, calibration.mlp[index], keep)
        for module in inputs:
            keep_outputs_(module, keep)
        keep_inputs_(down, keep)
    return model


def _ratio(mine, theirs) -> str:
    ratio, low, high = paired_ratio_interval(perplexity_from_losses(mine, 0), perplexity_from_losses(theirs, 0))
    return f"{perplexity_from_losses(mine, 0).value:.2f} (x{ratio:.3f} [{low:.3f}, {high:.3f}])"


def main() -> None:
    """Prints the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", required=True, help="a bench-decoder results.json")
    parser.add_argument("--width", type=int, required=True, help="the uniform MLP width compared against")
    args = parser.parse_args()
    config = DecoderBenchConfig.model_validate(json.loads(Path(args.results).read_text())["config"])
    torch.set_num_threads(2)
    dense, tokenizer = load_causal_lm(config.model)
    data = workload_data(config, tokenizer)
    calibration = calibrate(dense, data.calibration)
    base = shape_of(dense.config)
    uniform = cut_to_shape(dense, replace(base, mlp_width=args.width), calibration, "activation", True)
    scores = _scores(dense, calibration)
    widths = _widths(scores, args.width * base.layers)
    hetero = _cut_per_layer(dense, calibration, scores, widths)
    print(f"widths per layer (total {sum(widths)} = {base.layers} x {args.width}): {widths}")
    for name in ("val", "test"):
        blocks = getattr(data, name)
        print(
            f"{name}: heterogeneous {_ratio(block_losses(hetero, blocks), block_losses(uniform, blocks))} "
            f"against uniform {perplexity_from_losses(block_losses(uniform, blocks), 0).value:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
