"""Plan trials: brief training ranks plans, and replaces the allocation's only on evidence."""

from __future__ import annotations

import math

import numpy as np
import pytest


def test_plan_trials_rank_plans_by_brief_training_and_train_each_plan_once(pipeline_dir):
    """A plan that keeps every unit whole trains to far above one that keeps a channel per unit;
    the trials pick it whatever the order, prune copies (never the model) and train each plan once."""
    from pruneops.config import PruneConfig
    from pruneops.core.inputs import head_tensors
    from pruneops.data import load_prepared
    from pruneops.models.checkpoint import load_checkpoint
    from pruneops.planning.latency_allocation import PlanOption
    from pruneops.planning.trials import PlanTrials, trial_records
    from pruneops.pruning.methods import METHODS
    from pruneops.pruning.units import unit_sizes
    from pruneops.task.classification.prune import make_context

    _, train, val, _ = load_prepared(pipeline_dir / "artifacts/validate")
    model = load_checkpoint(pipeline_dir / "artifacts/train/model.safetensors").model
    example = head_tensors(val.x)
    config = PruneConfig(trials={"samples": len(train)})
    sizes = unit_sizes(model, example)

    def make_method(ratio, ratios):
        return METHODS.get(config.method)(make_context(config, train, example, ratio, ratios))

    whole = PlanOption(dict(sizes), dict.fromkeys(sizes, 0.0), 1.0, 0.0, False)
    gutted = PlanOption(dict.fromkeys(sizes, 1), {n: 1 - 1 / s for n, s in sizes.items()}, 0.1, 0.0, True)
    trials = PlanTrials(config, model, make_method, example, train, val)
    assert trials((gutted, whole)) == 1 and trials((whole, gutted)) == 0
    assert len(trials.records) == 2 and unit_sizes(model, example) == sizes
    by_widths = {tuple(r["widths"].values()): r for r in trials.records}
    kept, cut = by_widths[tuple(sizes.values())], by_widths[(1,) * len(sizes)]
    # Two accuracies on the same validation images: 3 standard errors of a difference of proportions.
    noise = 3 * math.sqrt(2 * 0.25 / len(val))
    assert kept["val_accuracy"] - cut["val_accuracy"] > noise, (kept, cut, noise)
    assert cut["uniform"] and not kept["uniform"] and all(r["seconds"] > 0 for r in trials.records)
    # The report marks which trialled plans the loop measured and which it kept.
    plans = ({"widths": dict(sizes), "kept": True}, {"widths": {**sizes, next(iter(sizes)): 2}, "kept": False})
    marked = {tuple(r["widths"].values()): (r["measured"], r["kept"]) for r in trial_records(trials, plans)}
    assert marked == {tuple(sizes.values()): (True, True), (1,) * len(sizes): (False, False)}


@pytest.mark.parametrize(("first", "other", "kept"), [(200, 201, 0), (200, 214, 1), (150, 216, 1), (216, 216, 0)])
def test_a_trial_replaces_the_allocations_plan_only_on_evidence(monkeypatch, first, other, kept):
    """Right on `first` and `other` of 216 validation samples (the second's right ones include the
    first's): one image more is noise and keeps the allocation's plan; 14 more (a paired standard
    error of 1.7 points, a gain of 6.5) replace it."""
    from pruneops.planning.latency_allocation import PlanOption
    from pruneops.planning.trials import TRIAL_EVIDENCE, PlanTrials, paired_gain

    answers = {"a": np.arange(216) < first, "b": np.arange(216) < other}
    monkeypatch.setattr(PlanTrials, "correct", lambda self, option: answers[next(iter(option.widths))])
    options = tuple(PlanOption({name: 1}, {name: 0.5}, 1.0, 0.1, False) for name in ("a", "b"))
    trials = PlanTrials(None, None, None, None, None, None)
    assert trials(options) == kept
    gain, error = paired_gain(answers["b"], answers["a"])
    assert gain == pytest.approx((other - first) / 216)
    assert (gain > TRIAL_EVIDENCE * error) == bool(kept)
