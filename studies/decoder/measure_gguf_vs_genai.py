"""A pruned decoder's gain over dense in llama.cpp (GGUF) and in onnxruntime-genai, timed interleaved in one process.

Usage: `python studies/decoder/measure_gguf_vs_genai.py --model assets/llm/smollm2-135m --mlp-width 704`
(after `make llm-assets llama-cpp`).

Cuts the dense model to a uniform MLP width (by magnitude: which weights a shape keeps does not
change its time), exports dense and the cut shape with onnxruntime-genai (fp32, INT8, INT4) and as
GGUF (Q8_0, Q4_K_M), and times all of them interleaved round by round through
`pruneops.timing.generation.time_interleaved` (batch 1, one thread, a random prompt). Prints each
model's time per output token and to the first token, its speed-up over dense fp32 in
onnxruntime-genai, and the pruned shape's gain over dense in the same runtime and precision, with
the ratio of llama.cpp's gain to onnxruntime-genai's (issue 91: within ±10 %).
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

FORMS = {"genai": ("fp32", "int8", "int4"), "llamacpp": ("q8_0", "q4_k_m")}
SAME_BITS = {"int8": "q8_0", "int4": "q4_k_m"}  # genai precision -> the llama.cpp format of its bit width


def main() -> None:
    """Prints the table and writes it as JSON beside the script's `--out`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a HuggingFace folder or GGUF file")
    parser.add_argument("--mlp-width", type=int, required=True)
    parser.add_argument("--prompt-length", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    torch.manual_seed(0)
    dense, tokenizer = load_causal_lm(args.model)
    pruned = cut_for_timing(dense, replace(shape_of(dense.config), mlp_width=args.mlp_width))
    opened = {}
    with tempfile.TemporaryDirectory(prefix="pruneops-gguf-vs-genai-") as work:
        for runtime_name, precisions in FORMS.items():
            runtime = get_runtime(runtime_name)
            for model_name, model in (("dense", dense), ("pruned", pruned)):
                folders = runtime.export(model, Path(work) / runtime_name / model_name, list(precisions),
                                         tokenizer=tokenizer)  # fmt: skip
                for precision, folder in folders.items():
                    opened[f"{model_name} {runtime_name} {precision}"] = runtime.open(folder).load()
        prompt = np.random.default_rng(0).integers(0, dense.config.vocab_size, (1, args.prompt_length))
        timings = time_interleaved(opened, DecodeWorkload(prompt, args.new_tokens, args.rounds))
    base = timings["dense genai fp32"].tpot_ms
    rows = {
        name: {"tpot_ms": t.tpot_ms, "ttft_ms": t.ttft_ms, "x_dense_fp32": base / t.tpot_ms}
        for name, t in timings.items()
    }
    gains = {}
    for runtime_name, precisions in FORMS.items():
        for precision in precisions:
            dense_ms, pruned_ms = (timings[f"{m} {runtime_name} {precision}"].tpot_ms for m in ("dense", "pruned"))
            gains[f"{runtime_name} {precision}"] = dense_ms / pruned_ms
    print(f"{'model':28s} {'ms/token':>9s} {'x dense fp32':>13s} {'first token ms':>15s}")
    for name, row in rows.items():
        print(f"{name:28s} {row['tpot_ms']:9.2f} {row['x_dense_fp32']:12.2f}x {row['ttft_ms']:15.1f}")
    print("\npruned gain over dense, same runtime and precision:")
    for name, gain in gains.items():
        print(f"  {name:20s} {gain:.2f}x")
    for genai, gguf in SAME_BITS.items():
        ratio = gains[f"llamacpp {gguf}"] / gains[f"genai {genai}"]
        print(f"  llama.cpp {gguf} gain / onnxruntime-genai {genai} gain: {ratio:.3f} ({100 * (ratio - 1):+.1f} %)")
    if args.out:
        versions = {**get_runtime("genai").versions(), **get_runtime("llamacpp").versions()}
        record = {"rows": rows, "gains": gains, "machine": machine_info(1, "genai"), "versions": versions,
                  "args": {k: str(v) for k, v in vars(args).items()}}  # fmt: skip
        args.out.write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
