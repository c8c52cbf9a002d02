"""The sensitivity stage's estimators: `fisher` predicts what `evaluate` measures, without evaluating.

On a small transformer trained on digits:
- a unit whose neurons reach nothing costs nothing to cut, exactly: the Fisher information of a
  mask on a silent neuron is zero, so the predicted loss increase is 0 up to the silent fraction,
  while every live unit's is positive; the allocation then cuts the silent unit first;
- across every (unit, ratio) point, the predicted loss increase ranks the points as the measured
  loss increase of `evaluate` does (Spearman correlation well above what unrelated curves give);
- the stage records the estimator, skips the chance-level filter (a loss is not an accuracy) and
  plans a latency target from the predicted curves;
- it saves the scores, and the prune stage's `fisher` method ranks by them instead of computing
  them again, for the model they scored only.
"""

import copy
import shutil

import numpy as np
import pytest
import torch

from pruneops.config import ConfigError, PruneConfig, SensitivityConfig
from pruneops.core.io import read_json
from pruneops.core.params import parse_section, read_params
from pruneops.data import load_prepared
from pruneops.models.checkpoint import load_checkpoint
from pruneops.pipeline.runner import run_stage
from pruneops.planning.allocation import allocate_ratios
from pruneops.planning.sensitivity import fisher_sweep
from pruneops.pruning import methods
from pruneops.pruning.fisher import load_fisher_scores
from pruneops.pruning.heads import head_sites
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.methods import FisherPruning
from pruneops.pruning.units import UnitPruner
from pruneops.task.classification.prune import make_context
from pruneops.training.fit import evaluate
from tests.conftest import prune_section, tiny_params, write_params

RATIOS = [0.25, 0.5, 0.75]
RUNS = 5  # independent latency-table and gate timings of one plan (see the latency-target test)
TRANSFORMER = {"model": "transformer", "model_kwargs": {"dim": 32, "ffn_dim": 64}}


def _params(tmp_path, estimator: str, fisher_samples: int = 512, **prune):
    return write_params(
        tmp_path,
        tiny_params(
            train=TRANSFORMER,
            prune={**prune_section("fisher", 0.5, max_unit_ratio=0.9), **prune},
            sensitivity={"ratios": RATIOS, "estimator": estimator, "fisher_samples": fisher_samples},
        ),
    )


@pytest.fixture(scope="module")
def trained(pipeline_dir, tmp_path_factory):
    """A directory with the digits split and a trained small transformer."""
    root = tmp_path_factory.mktemp("fisher-sweep")
    shutil.copytree(pipeline_dir / "artifacts/validate", root / "artifacts/validate")
    run_stage("train", _params(root, "evaluate"), root)
    return root


def _spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def test_silent_neurons_cost_nothing_and_are_cut_first(trained):
    meta, train, val, _ = load_prepared(trained / "artifacts/validate")
    model = load_checkpoint(trained / "artifacts/train/model.safetensors").model
    pruner = UnitPruner(model, torch.from_numpy(val.x[:1]), IMPORTANCES.get("l2"))
    consumers = pruner.linear_consumers()
    silent = next(iter(consumers))
    with torch.no_grad():  # half of this FFN's neurons reach nothing
        consumers[silent].weight[:, : consumers[silent].in_features // 2] = 0
    config = parse_section("sensitivity", {"ratios": RATIOS, "estimator": "fisher"}, SensitivityConfig)
    result = fisher_sweep(config, model, train, val, meta.input_shape, True, evaluate(model, val))
    curves, weights = result.curves, result.weights
    assert not result.warnings and set(curves) == set(pruner.units())
    cost = dict(zip(curves[silent]["ratios"], curves[silent]["predicted_loss_increase"], strict=True))
    assert cost[0.25] == 0.0 and cost[0.5] == 0.0 and cost[0.75] > 0.0
    others = [c["predicted_loss_increase"][0] for n, c in curves.items() if n != silent]
    assert min(others) > 0.0
    # A target the silent half alone can meet is met by cutting it alone.
    share = 0.5 * weights[silent] / sum(weights.values())
    ratios = allocate_ratios(curves, weights, share * 0.99, 0.9)
    assert ratios[silent] == pytest.approx(0.5, abs=0.02)
    assert all(r == 0.0 for n, r in ratios.items() if n != silent)


def test_fisher_ranks_points_as_measured_loss_does(trained, tmp_path):
    sweeps = {}
    for estimator in ("evaluate", "fisher"):
        work = tmp_path / estimator
        shutil.copytree(trained / "artifacts", work / "artifacts")
        run_stage("sensitivity", _params(work, estimator), work)
        sweeps[estimator] = read_json(work / "artifacts/sensitivity/sensitivity.json")
    measured, predicted = sweeps["evaluate"]["units"], sweeps["fisher"]["units"]
    assert set(measured) == set(predicted)
    pairs = [
        (m, p)
        for name in measured
        for m, p in zip(measured[name]["loss_increase"], predicted[name]["predicted_loss_increase"], strict=True)
    ]
    rho = _spearman(*zip(*pairs, strict=True))
    # The points include deeper cuts of the same unit, which both rank higher; a random
    # predictor keeps only that within-unit order. Shuffling units' curves measures that floor.
    rng = np.random.default_rng(0)
    names = list(measured)
    floors = []
    for _ in range(50):
        perm = dict(zip(names, rng.permutation(names), strict=True))
        shuffled = [
            (m, p)
            for name in names
            for m, p in zip(
                measured[name]["loss_increase"], predicted[perm[name]]["predicted_loss_increase"], strict=True
            )
        ]
        floors.append(_spearman(*zip(*shuffled, strict=True)))
    print(f"Spearman rho {rho:.3f}; shuffled units' 95th percentile {np.percentile(floors, 95):.3f}")
    assert rho > 0.6 and rho > np.percentile(floors, 95), (rho, np.percentile(floors, 95))
    assert sweeps["fisher"]["estimator"] == "fisher" and sweeps["fisher"]["chance_drop"] is None


@pytest.mark.slow
def test_fisher_sweep_plans_a_latency_target(trained, tmp_path, monkeypatch):
    shutil.copytree(trained / "artifacts", tmp_path / "artifacts")
    params = _params(tmp_path, "fisher", target={"kind": "latency_ratio", "value": 0.6}, steps=1)
    run_stage("sensitivity", params, tmp_path)
    assert (tmp_path / "artifacts/sensitivity/fisher_scores.safetensors").exists()
    assert read_json(tmp_path / "metrics/sensitivity.json")["evaluations"] == 0
    # The prune stage ranks by the sweep's saved scores: it has no reason to compute them again.
    monkeypatch.setattr(methods, "fisher_scores", _must_not_run)
    errors = []
    for _ in range(RUNS):
        run_stage("latency", params, tmp_path)
        assert (tmp_path / "artifacts/latency/fp32/latency_table.json").exists()
        run_stage("prune", params, tmp_path)
        prune = read_json(tmp_path / "metrics/prune.json")
        assert prune["predicted_latency_ms"] is not None
        errors.append(prune["latency_prediction_error"])
    # The plan came from the table over the predicted curves, and the table predicted what it
    # planned. How far it cut is not asserted: the tiny model's 0.05-0.2 ms is mostly per-operator
    # overhead, so the (unreachable) 0.6 led to 1.0x-3.8x fewer MACs from run to run here, 1.0x
    # where the table measured no cut worth its accuracy. One run's error is one timing of each
    # side: dense itself read 0.078-0.178 ms in five runs here, single runs' errors spread from
    # -0.13 to +0.14, and a CI run's read -0.17. A table that misfits this model misses in most
    # runs (a 25 % bias read +0.09, +0.31, +0.43 here); the median of independent runs, table and
    # gate timed again in each, is what the 15 % bound holds.
    print(f"latency prediction errors {[round(e, 3) for e in errors]}")
    assert abs(float(np.median(errors))) < 0.15, errors


def _must_not_run(*_, **__):
    raise AssertionError("Fisher scores computed again")


def test_saved_fisher_scores_serve_only_the_model_they_scored(trained, tmp_path):
    shutil.copytree(trained / "artifacts", tmp_path / "artifacts")
    # As many samples as the prune method takes when it computes the scores itself.
    params = _params(tmp_path, "fisher", fisher_samples=FisherPruning.CALIBRATION_SAMPLES)
    run_stage("sensitivity", params, tmp_path)
    _, train, val, _ = load_prepared(tmp_path / "artifacts/validate")
    model = load_checkpoint(tmp_path / "artifacts/train/model.safetensors").model
    config = parse_section("prune", read_params(params)["prune"], PruneConfig)
    ctx = make_context(config, train, torch.from_numpy(val.x[:1]), 0.5, None)
    saved_dir = tmp_path / "artifacts/sensitivity"
    heads, channels = FisherPruning.shared_scores(model, ctx, saved_dir)
    computed_heads, computed_channels = FisherPruning.shared_scores(model, ctx, None)
    # Same samples, other batching (sensitivity's batch size, not prune's): equal up to rounding.
    for saved, fresh in ((heads, computed_heads), (channels, computed_channels)):
        assert saved.keys() == fresh.keys()
        for name in saved:
            torch.testing.assert_close(saved[name], fresh[name], rtol=1e-3, atol=1e-9)
    # Scores of another model (here: one with a narrower FFN) are not taken for this one's.
    narrow = copy.deepcopy(model)
    pruner = UnitPruner(narrow, torch.from_numpy(val.x[:1]), IMPORTANCES.get("l2"))
    unit = next(iter(pruner.linear_consumers()))
    pruner.prune_to_({unit: pruner.units()[unit].size // 2})
    assert load_fisher_scores(saved_dir / "fisher_scores.safetensors", head_sites(narrow), {}) is not None
    narrow_consumers = UnitPruner(narrow, torch.from_numpy(val.x[:1]), IMPORTANCES.get("l2")).linear_consumers()
    assert load_fisher_scores(saved_dir / "fisher_scores.safetensors", {}, narrow_consumers) is None


def test_fisher_estimator_refuses_unstructured_methods(trained, tmp_path):
    shutil.copytree(trained / "artifacts", tmp_path / "artifacts")
    params = write_params(
        tmp_path,
        tiny_params(
            train=TRANSFORMER,
            prune=prune_section("magnitude", 0.5),
            sensitivity={"ratios": RATIOS, "estimator": "fisher"},
        ),
    )
    with pytest.raises(ConfigError, match="use evaluate for unstructured methods"):
        run_stage("sensitivity", params, tmp_path)


def test_unknown_estimator_is_refused_at_load():
    with pytest.raises(ConfigError, match="sensitivity.estimator: unknown sensitivity estimator 'hessian'"):
        parse_section("sensitivity", {"estimator": "hessian"}, SensitivityConfig)


def test_the_scoring_subset_keeps_every_class_in_its_share_and_follows_the_seed():
    from pruneops.data import Split
    from pruneops.planning.sensitivity import stratified_subset

    y = np.repeat(np.arange(4), [500, 300, 150, 50])
    split = Split(np.arange(len(y), dtype=np.float32)[:, None], y)
    picked = stratified_subset(split, 200, seed=0)
    assert len(picked) == 200
    # Proportional quotas (100, 60, 30, 10) are whole here, so they are met exactly.
    assert np.bincount(picked.y).tolist() == [100, 60, 30, 10]
    index = picked.x[:, 0].astype(int)
    assert np.all(np.diff(index) > 0) and np.array_equal(y[index], picked.y)  # original order, no repeats
    assert np.array_equal(stratified_subset(split, 200, seed=0).x, picked.x)
    assert not np.array_equal(stratified_subset(split, 200, seed=1).x, picked.x)
    odd = stratified_subset(split, 97, seed=0)  # quotas 48.5, 29.1, 14.55, 4.85: remainders decide
    assert len(odd) == 97 and np.bincount(odd.y).tolist() == [48, 29, 15, 5]


def test_the_sweep_scores_on_val_samples_when_asked(pipeline_dir, tmp_path):
    from pruneops.planning.sensitivity import stratified_subset

    for stage in ("validate", "train"):
        shutil.copytree(pipeline_dir / "artifacts" / stage, tmp_path / "artifacts" / stage)
    params = tiny_params(sensitivity={"ratios": [0.5], "val_samples": 120})
    run_stage("sensitivity", write_params(tmp_path, params), tmp_path)
    sweep = read_json(tmp_path / "artifacts/sensitivity/sensitivity.json")
    _, _, val, _ = load_prepared(tmp_path / "artifacts/validate")
    assert len(val) > 120 and sweep["val_samples"] == 120
    base = load_checkpoint(tmp_path / "artifacts/train/model.safetensors").model
    subset = stratified_subset(val, 120, params["sensitivity"]["seed"])
    assert sweep["baseline_val_accuracy"] == pytest.approx(evaluate(base, subset)[0])
