"""The zero-shot check's scoring: one prefill per answer against one per item (`answer_losses`), interleaved.

Usage: `python studies/decoder/measure_zero_shot_prefill.py --model assets/llm/smollm2-135m --out
studies/decoder/zero_shot_prefill.json` (after `make llm-assets llama-cpp`).

Exports the model as onnxruntime-genai INT8 and GGUF Q8_0 (the 8-bit forms `quantize` scores),
builds the check's items as `validate` does (the reviews of `assets/llm/reviews.csv`, the bench's
prompt, the labels " positive" and " negative"), and scores every item both ways, the order
alternating item by item, with 2 threads as `quantize` opens its candidates. Prints each way's
median time per item, the ratio, and the largest difference between their losses (0: the same rows).
"""

import argparse
import csv
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # studies is not installed
from pruneops.data.zero_shot import answer_losses
from pruneops.models.decoders import load_causal_lm
from pruneops.runtimes import get_runtime
from pruneops.timing.machine import machine_info

FORMS = {"genai": "int8", "llamacpp": "q8_0"}
PROMPT = "Movie review: {text}\nThe review is"


def each_alone(opened, context: list[int], answers: list[list[int]]) -> list[float]:
    """Every answer prefilled after the context on its own (the scoring before `answer_losses`)."""
    return [float(opened.token_losses(np.asarray(context + a))[len(context) - 1 :].sum()) for a in answers]


def main() -> None:
    """Prints the table and writes it as JSON to `--out`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a HuggingFace folder or GGUF file")
    parser.add_argument("--reviews", default="assets/llm/reviews.csv")
    parser.add_argument("--items", type=int, default=60)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model, tokenizer = load_causal_lm(args.model)
    with open(args.reviews, newline="") as f:
        texts = [row["text"] for row, _ in zip(csv.DictReader(f), range(args.items), strict=False)]
    contexts = [tokenizer(PROMPT.format(text=t))["input_ids"] for t in texts]
    answers = [tokenizer(" " + label, add_special_tokens=False)["input_ids"] for label in ("positive", "negative")]
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, precision in FORMS.items():
            runtime = get_runtime(name)
            folder = runtime.export(model, Path(tmp) / name, [precision], tokenizer=tokenizer)[precision]
            opened = runtime.open(folder, threads=2)
            times, worst = {"alone": [], "one prefill": []}, 0.0
            for i, context in enumerate(contexts):
                ways = [("alone", each_alone), ("one prefill", answer_losses)]
                got = {}
                for way, score in ways if i % 2 == 0 else ways[::-1]:
                    start = time.perf_counter()
                    got[way] = score(opened, context, answers)
                    times[way].append(time.perf_counter() - start)
                worst = max(worst, float(np.abs(np.subtract(got["alone"], got["one prefill"])).max()))
            alone, shared = (float(np.median(times[w])) * 1000 for w in ("alone", "one prefill"))
            rows[f"{name} {precision}"] = {
                "alone_ms": alone,
                "one_prefill_ms": shared,
                "ratio": alone / shared,
                "max_diff": worst,
            }
            print(
                f"{name} {precision}: {alone:.1f} ms an item alone, {shared:.1f} ms one prefill, "
                f"{alone / shared:.2f}×, max |Δ loss| {worst:.1e}"
            )
    context_tokens = [len(c) for c in contexts]
    spread = [min(context_tokens), int(np.median(context_tokens)), max(context_tokens)]
    result = {
        "machine": machine_info(2, *FORMS),
        "items": len(contexts),
        "context_tokens": spread,
        "answers": answers,
        "rows": rows,
    }
    print(json.dumps(result["context_tokens"]), result["machine"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
