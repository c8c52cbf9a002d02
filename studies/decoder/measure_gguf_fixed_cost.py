"""Where llama.cpp's smaller gain from an MLP cut goes: per-token time against MLP width, both runtimes, at 8 bits.

Usage: `python studies/decoder/measure_gguf_fixed_cost.py --model assets/llm/smollm2-135m
--mlp-widths 1536 1152 704 352` (after `make llm-assets llama-cpp`).

Cuts the dense model to each uniform MLP width (by magnitude: which weights a shape keeps does not
change its time), exports every shape as onnxruntime-genai INT8 and GGUF Q8_0, times all of them
interleaved round by round (`pruneops.timing.generation.time_interleaved`: batch 1, one thread, a
random prompt), and fits each runtime's time per output token as `fixed + slope x MLP width`. The
fixed part is what an MLP cut cannot touch (attention, the output head, the runtime's per-step
work); the slope is what each MLP neuron of every layer costs. A runtime with a larger fixed part
keeps less of a cut's relative gain, whatever the cut.
"""

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # studies is not installed
from pruneops.models.decoders import load_causal_lm
from pruneops.planning.decode_cost import shape_of
from pruneops.runtimes import get_runtime
from pruneops.task.causal_lm.common import cut_for_timing
from pruneops.timing.generation import DecodeWorkload, time_interleaved
from pruneops.timing.machine import machine_info

FORMS = {"genai": "int8", "llamacpp": "q8_0"}


def _fit(widths: list[int], times: list[float]) -> dict:
    """Least-squares `fixed + slope x width`, with its RMS residual (ms)."""
    design = np.stack([np.ones(len(widths)), np.asarray(widths, dtype=float)], axis=1)
    (fixed, slope), *_ = np.linalg.lstsq(design, np.asarray(times), rcond=None)
    residual = float(np.sqrt(np.mean((design @ np.array([fixed, slope]) - np.asarray(times)) ** 2)))
    return {"fixed_ms": float(fixed), "ms_per_neuron": float(slope), "rms_residual_ms": residual}


def main() -> None:
    """Prints each shape's time in both runtimes and the two fits; writes them as JSON to `--out`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a HuggingFace folder or GGUF file")
    parser.add_argument("--mlp-widths", type=int, nargs="+", required=True)
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    torch.manual_seed(0)
    dense, tokenizer = load_causal_lm(args.model)
    opened = {}
    with tempfile.TemporaryDirectory(prefix="pruneops-gguf-fixed-cost-") as work:
        for width in args.mlp_widths:
            model = cut_for_timing(dense, replace(shape_of(dense.config), mlp_width=width))
            for runtime_name, precision in FORMS.items():
                runtime = get_runtime(runtime_name)
                folder = Path(work) / runtime_name / str(width)
                folders = runtime.export(model, folder, [precision], tokenizer=tokenizer)
                opened[f"{runtime_name} {precision} MLP {width}"] = runtime.open(folders[precision]).load()
        prompt = np.random.default_rng(0).integers(0, dense.config.vocab_size, (1, args.prompt_length))
        timings = time_interleaved(opened, DecodeWorkload(prompt, args.new_tokens, args.rounds))
    rows = {name: {"tpot_ms": t.tpot_ms, "ttft_ms": t.ttft_ms} for name, t in timings.items()}
    fits = {}
    for runtime_name, precision in FORMS.items():
        times = [timings[f"{runtime_name} {precision} MLP {w}"].tpot_ms for w in args.mlp_widths]
        fits[f"{runtime_name} {precision}"] = _fit(args.mlp_widths, times)
    print(f"{'model':28s} {'ms/token':>9s} {'first token ms':>15s}")
    for name, row in rows.items():
        print(f"{name:28s} {row['tpot_ms']:9.2f} {row['ttft_ms']:15.1f}")
    print("\nfit: ms per token = fixed + slope x MLP width")
    for name, fit in fits.items():
        print(f"  {name:16s} fixed {fit['fixed_ms']:.2f} ms, {1000 * fit['ms_per_neuron']:.3f} ms per 1000 neurons "
              f"(RMS residual {fit['rms_residual_ms']:.2f} ms)")  # fmt: skip
    if args.out:
        versions = {**get_runtime("genai").versions(), **get_runtime("llamacpp").versions()}
        record = {"rows": rows, "fits": fits, "machine": machine_info(1, "genai"), "versions": versions,
                  "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
        args.out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
