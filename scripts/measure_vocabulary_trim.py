"""What `prune.trim_vocabulary` costs a fine-tuned text model, with no training after the trim.

Run in a project whose `validate` and `train` stages have run (for the README's figure: the text
bench's validate/train params, `pruneops validate && pruneops train`, then
`python scripts/measure_vocabulary_trim.py`). Prints JSON: rows and parameters removed, unknown-token
rates, and val/test accuracy before and after with paired-bootstrap 95% intervals of the change.
"""

import json
from pathlib import Path

import torch

from pruneops.bench.report import paired_bootstrap_ci
from pruneops.checkpoint import load_checkpoint
from pruneops.data import load_prepared
from pruneops.forward import predict_logits
from pruneops.io import Layout
from pruneops.pruning.vocabulary import trim_vocabulary


def main() -> None:
    """Trims the train stage's model in memory and prints what changed."""
    torch.set_num_threads(2)
    layout = Layout(Path("."))
    _, train, val, test = load_prepared(layout.stage_dir("validate"))
    model = load_checkpoint(layout.stage_dir("train") / "model.safetensors").model
    splits = {"val": val, "test": test}

    def correct() -> dict:
        return {n: predict_logits(model, s.x).argmax(1).numpy() == s.y for n, s in splits.items()}

    before, params_before = correct(), sum(p.numel() for p in model.parameters())
    # The val accuracy just measured is the untrimmed one: no second evaluation inside the trim.
    trimmed = trim_vocabulary(model, layout, train, val, test, float(before["val"].mean()))
    result = {"params_before": params_before, **trimmed}
    after = correct()
    result["params_after"] = sum(p.numel() for p in model.parameters())
    for n in splits:
        result[f"{n}_accuracy_before"] = float(before[n].mean())
        result[f"{n}_accuracy_after"] = float(after[n].mean())
        result[f"{n}_change_points_ci95"] = paired_bootstrap_ci(after[n], before[n])
        result[f"{n}_predictions_changed"] = int((before[n] != after[n]).sum())
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
