"""How many zero-shot items the 3-point budget needs: each dense form's change and interval at nested counts.

Usage: `python studies/decoder/measure_zero_shot_items.py --model assets/llm/smollm2-135m --out
studies/decoder/zero_shot_items.json` (after `make llm-assets llama-cpp`).

Builds the check as `validate` does (`assets/llm/reviews.csv`, the bench's prompt, the labels the
file gives) with `--items` items, so its gating half holds `--items / 2`; exports dense fp32
(onnxruntime-genai, the reference `quantize` compares with) and the dense forms `quantize` weighs
(genai INT8 and INT4, llama.cpp Q8_0 and Q4_K_M); scores every gating item in each, with 2 threads
as `quantize` opens its candidates. For the first n gating items, n nested (what `zero_shot_items`
of 2n would gate on, drawn the same way), prints each form's change against dense fp32 in points,
its paired 95 % interval (`accuracy_change`, as the budget reads it), whether the far end holds
`--budget`, and the share of items whose answer the form changes; and each form's time per item.
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # studies is not installed
from pruneops.config import ValidateConfig
from pruneops.core.quality import accuracy_change
from pruneops.data.zero_shot import zero_shot_correct
from pruneops.models.decoders import load_causal_lm
from pruneops.runtimes import get_runtime
from pruneops.task.causal_lm.validate import _zero_shot_items
from pruneops.timing.machine import machine_info

FORMS = (("genai", "fp32"), ("genai", "int8"), ("genai", "int4"), ("llamacpp", "q8_0"), ("llamacpp", "q4_k_m"))
PROMPT = "Movie review: {text}\nThe review is"  # benchmarks/llm.yaml's


def main() -> None:
    """Prints the table and writes it as JSON to `--out`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a HuggingFace folder or GGUF file")
    parser.add_argument("--reviews", default="assets/llm/reviews.csv")
    parser.add_argument("--items", type=int, default=2000, help="zero_shot_items: the gating half is half of it")
    parser.add_argument("--counts", default="100,200,300,450,600,1000", help="gating items to judge on, nested")
    parser.add_argument("--budget", type=float, default=3.0, help="prune.gate.max_zero_shot_drop (points)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model, tokenizer = load_causal_lm(args.model)
    config = ValidateConfig(
        dataset="corpus", path=args.reviews, tokenizer=args.model, zero_shot=args.reviews,
        zero_shot_prompt=PROMPT, zero_shot_items=args.items,
    )  # fmt: skip
    check = _zero_shot_items(config, tokenizer)
    gating = len(check["zero_shot_val"])
    correct, per_item_ms = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, precision in FORMS:
            runtime = get_runtime(name)
            folder = runtime.export(model, Path(tmp) / name, [precision], tokenizer=tokenizer)[precision]
            opened = runtime.open(folder, threads=2)
            start = time.perf_counter()
            correct[f"{name} {precision}"] = zero_shot_correct(opened, check, "zero_shot_val")
            per_item_ms[f"{name} {precision}"] = (time.perf_counter() - start) / gating * 1000
            print(f"{name} {precision}: accuracy {correct[f'{name} {precision}'].mean():.3f} on {gating} gating items, "
                  f"{per_item_ms[f'{name} {precision}']:.1f} ms an item")  # fmt: skip
    dense = correct["genai fp32"]
    rows = []
    for n in (int(c) for c in args.counts.split(",") if int(c) <= gating):
        for form, answers in correct.items():
            if form == "genai fp32":
                continue
            change = accuracy_change(answers[:n], dense[:n])
            changed = float(np.mean(answers[:n] != dense[:n]))
            held = -change.low <= args.budget + 1e-12
            rows.append({"gating_items": n, "form": form, **change.record(), "answers_changed": changed, "held": held})
            verdict = "holds" if held else "out"
            print(f"{n:5d} {form:16s} {change.text():28s} {verdict:5s} {changed:.1%} of answers changed")
    result = {
        "machine": machine_info(2, "genai", "llamacpp"),
        "items": args.items,
        "gating_items": gating,
        "budget_points": args.budget,
        "dense_accuracy": float(dense.mean()),
        "per_item_ms": per_item_ms,
        "rows": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
