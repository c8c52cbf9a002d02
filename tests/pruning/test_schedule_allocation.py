import pytest

from pruneops.config import PruneConfig
from pruneops.planning.allocation import allocate_ratios, interpolated_drop
from pruneops.planning.loop import planned_widths
from pruneops.planning.targets import Plan
from pruneops.pruning.schedule import SCHEDULES
from pruneops.pruning.units import is_head_unit, round_keep


def test_cubic_schedule_follows_zhu_gupta():
    steps = SCHEDULES.get("cubic")(4)
    assert steps == pytest.approx([1 - 0.75**3, 1 - 0.5**3, 1 - 0.25**3, 1.0])
    assert all(b > a for a, b in zip(steps, steps[1:], strict=False))
    increments = [b - a for a, b in zip([0.0, *steps], steps, strict=False)]
    assert increments == sorted(increments, reverse=True)


def test_linear_and_oneshot_end_at_target():
    assert SCHEDULES.get("linear")(5)[-1] == pytest.approx(1.0)
    assert SCHEDULES.get("oneshot")(3) == [1.0, 1.0, 1.0]


def test_round_keep_respects_multiples_and_keeps_one():
    assert round_keep(64, 0.5, None) == 32
    assert round_keep(64, 0.55, 8) == 32
    assert round_keep(10, 0.99, None) == 1
    assert round_keep(16, 0.9, 8) == 8


def test_head_units_are_never_rounded_to_channel_multiples():
    # A tie at the model's root (MPNet's encoder as the model) names its unit plain "heads".
    assert is_head_unit("heads") and is_head_unit("encoder.layer.0.attention.heads")
    assert not is_head_unit("blocks.0.heads_proj") and not is_head_unit("multiheads")
    sizes = {"heads": 12, "encoder.heads": 12, "stages.0.conv1": 64}
    config = PruneConfig(target={"kind": "ratio", "value": 0.5}, round_to=8)
    widths = planned_widths(config, sizes, Plan(0.5, ratios=dict.fromkeys(sizes, 0.5)))
    # 12 heads at half keep 6 (rounded to 8 they would keep 8, a third more than planned).
    assert widths == {"heads": 6, "encoder.heads": 6, "stages.0.conv1": 32}


def test_allocation_meets_target_and_spares_the_sensitive_unit():
    grid = [0.25, 0.5, 0.75]
    curves = {
        "robust": {"ratios": grid, "accuracy_drop": [0.0, 0.01, 0.02]},
        "fragile": {"ratios": grid, "accuracy_drop": [0.2, 0.5, 0.9]},
    }
    alloc = allocate_ratios(curves, {"robust": 100, "fragile": 100}, target=0.35, max_ratio=0.75)
    # The robust unit's last step (0.5 -> 0.75) overshoots, so it stops where the target is met.
    assert alloc["robust"] == pytest.approx(0.70) and alloc["fragile"] == 0.0
    achieved = (100 * alloc["robust"] + 100 * alloc["fragile"]) / 200
    assert achieved == pytest.approx(0.35)


def test_allocation_weights_by_cost():
    grid = [0.5]
    curves = {"cheap": {"ratios": grid, "accuracy_drop": [0.01]}, "costly": {"ratios": grid, "accuracy_drop": [0.01]}}
    alloc = allocate_ratios(curves, {"cheap": 1.0, "costly": 99.0}, target=0.4, max_ratio=0.9)
    assert alloc["cheap"] == 0.0 and alloc["costly"] == pytest.approx(40 / 99)


def test_allocation_follows_the_target_smoothly_and_never_below_a_measured_step():
    grid = [0.25, 0.5, 0.75]
    curves = {
        "a": {"ratios": grid, "accuracy_drop": [0.0, 0.01, 0.3]},
        "b": {"ratios": grid, "accuracy_drop": [0.0, 0.02, 0.05]},
    }
    sizes = {"a": 30.0, "b": 70.0}
    previous = None
    for target in [i / 100 for i in range(5, 71, 5)]:
        alloc = allocate_ratios(curves, sizes, target, max_ratio=0.75)
        achieved = sum(sizes[n] * r for n, r in alloc.items()) / 100
        assert achieved == pytest.approx(target, abs=1e-9)
        if previous is not None:
            # Raising the target never gives a unit back more than the step it was interpolating.
            assert sum(alloc.values()) >= sum(previous.values()) - 1e-9
        previous = alloc


def test_interpolated_drop_is_linear_between_measured_ratios_and_monotone():
    curve = {"ratios": [0.25, 0.5, 0.75], "accuracy_drop": [0.02, 0.01, 0.1]}  # noise: 0.01 < 0.02
    assert interpolated_drop(curve, 0.0) == 0.0
    assert interpolated_drop(curve, 0.125) == pytest.approx(0.01)
    assert interpolated_drop(curve, 0.5) == pytest.approx(0.02)  # running maximum
    assert interpolated_drop(curve, 0.625) == pytest.approx(0.06)
    assert interpolated_drop(curve, 0.9) == pytest.approx(0.1)


def test_unreachable_target_stops_at_max_ratio():
    curves = {"u": {"ratios": [0.5, 0.9], "accuracy_drop": [0.0, 0.1]}}
    assert allocate_ratios(curves, {"u": 10}, target=0.95, max_ratio=0.5) == {"u": 0.5}


def test_prune_stage_refuses_a_target_out_of_the_sweeps_reach(pipeline_dir, tmp_path):
    import shutil

    from pruneops.core.errors import ConfigError
    from pruneops.pipeline.runner import run_stage
    from tests.conftest import tiny_params, write_params

    for part in ("artifacts/validate", "artifacts/train"):
        shutil.copytree(pipeline_dir / part, tmp_path / part)
    params = write_params(
        tmp_path, tiny_params(prune={"target": {"kind": "ratio", "value": 0.85}}, sensitivity={"ratios": [0.25, 0.5]})
    )
    run_stage("sensitivity", params, tmp_path)  # the sweep does not depend on the target
    assert (tmp_path / "artifacts/sensitivity/sensitivity.json").exists()
    with pytest.raises(ConfigError, match=r"prune.target.value: ratio 0.85 is out of reach of the sweep"):
        run_stage("prune", params, tmp_path)
    assert not (tmp_path / "artifacts/prune").exists()
