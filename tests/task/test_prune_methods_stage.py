"""Every pruning method through the sensitivity, prune and finetune stages on digits."""

import shutil

import pytest

from pruneops.core.io import read_json
from pruneops.pipeline.runner import run_stage
from tests.conftest import prune_section, tiny_params, write_params

_TRAINED: dict[str, object] = {}  # model kind -> a project where validate and train ran (the same for every method)


def _trained(model: str, pipeline_dir, tmp_path_factory, project) -> None:
    """`project` gets the digits split and the `model` train fits with its params (fitted once per kind).

    Train reads no `prune` key, so the methods of one kind share one fit: seeded, it is the same model.
    """
    if model not in _TRAINED:
        root = tmp_path_factory.mktemp(f"trained-{model}")
        shutil.copytree(pipeline_dir / "artifacts/validate", root / "artifacts/validate")
        shutil.copy(project / "params.yaml", root / "params.yaml")
        run_stage("train", root / "params.yaml", root)
        _TRAINED[model] = root
    root = _TRAINED[model]
    for part in [p for p in root.iterdir() if p.name != "params.yaml"]:
        copy = shutil.copytree if part.is_dir() else shutil.copy
        copy(part, project / part.name)


@pytest.mark.parametrize(
    ("method", "model", "target"),
    [
        ("magnitude", "cnn", 0.8),
        ("movement", "cnn", 0.8),
        ("semi_structured", "mlp", 0.5),
        ("head", "transformer", 0.5),
        ("fisher", "transformer", 0.5),
        ("channel", "transformer", 0.5),
    ],
)
def test_method_through_stages(pipeline_dir, tmp_path_factory, tmp_path, method, model, target):
    kwargs = {"cnn": {"widths": [16, 32]}, "mlp": {"hidden": [64, 64]}, "transformer": {"dim": 32, "ffn_dim": 64}}[
        model
    ]
    params = write_params(
        tmp_path,
        tiny_params(
            train={"model": model, "model_kwargs": kwargs},
            prune=prune_section(method, None if method == "semi_structured" else target, max_unit_ratio=0.9),
            sensitivity={"ratios": [0.25, 0.5, 0.75, 0.9]},
        ),
    )
    _trained(model, pipeline_dir, tmp_path_factory, tmp_path)
    for stage in ("sensitivity", "prune", "finetune"):
        run_stage(stage, params, tmp_path)
    alloc = {
        **read_json(tmp_path / "artifacts/sensitivity/sensitivity.json"),
        **read_json(tmp_path / "artifacts/prune/allocation.json"),
    }
    prune = read_json(tmp_path / "metrics/prune.json")
    finetune = read_json(tmp_path / "metrics/finetune.json")
    if method in ("channel", "head", "fisher"):
        assert alloc["granularity"] == "units"
        assert prune["mac_reduction"] > 1.5 and prune["weight_zero_fraction"] == 0.0
    else:
        assert alloc["granularity"] == "layers"
        assert prune["mac_reduction"] == 1.0
        assert "none" in prune["speedup"] or "not available" in prune["speedup"]
        # The masks stay through fine-tuning and are made permanent.
        assert finetune["weight_zero_fraction"] == pytest.approx(prune["weight_zero_fraction"], abs=1e-6)
    if method in ("magnitude", "movement"):
        # Allocation meets the target over prunable weights; the classifier is never pruned.
        sizes, ratios = alloc["weights"], alloc["ratios"]
        achieved = sum(sizes[n] * ratios[n] for n in sizes) / sum(sizes.values())
        assert achieved >= target - 1e-6
        sparsity = read_json(tmp_path / "artifacts/prune/sparsity.json")
        zeros = sum(sparsity["layers"][n[: -len(".weight")]]["zero_fraction"] * sizes[n] for n in sizes)
        assert zeros / sum(sizes.values()) == pytest.approx(achieved, abs=0.01)
    if method == "semi_structured":
        assert prune["weight_zero_fraction"] > 0.3
    assert finetune["test_accuracy"] > 0.5
