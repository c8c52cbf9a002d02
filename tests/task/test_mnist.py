"""The same stages on real MNIST with the cnn model, changing only params (needs ../shared)."""

import pytest

from tests.conftest import MNIST, tiny_params, write_params

pytestmark = [
    pytest.mark.slow(reason="every stage on 60,000 real MNIST images with the cnn model"),
    pytest.mark.skipif(not MNIST.exists(), reason=f"real MNIST not present at {MNIST}"),
]


def test_mnist_cnn_pipeline_by_params_only(tmp_path):
    from pruneops.core.io import read_json
    from pruneops.pipeline.runner import run_stage
    from pruneops.pipeline.stages import STAGE_NAMES

    params = tiny_params(
        validate={"dataset": "npz", "path": str(MNIST), "max_train_samples": 6000, "val_fraction": 0.05},
        train={"model": "cnn", "epochs": 4, "model_kwargs": {"widths": [16, 32]}},
        finetune={"epochs": 3, "patience": 3},
    )
    path = write_params(tmp_path, params)
    for stage in STAGE_NAMES:
        run_stage(stage, path, tmp_path)
    validate = read_json(tmp_path / "metrics/validate.json")
    assert validate["n_test"] == 10_000 and validate["n_features"] == 784
    train = read_json(tmp_path / "metrics/train.json")
    # Here (2026-11-23) the baseline reached 95.3% and the deployed pruned model 89.9% on the
    # 10,000 test images (standard error ~0.3 pt): the bounds leave room for float differences
    # between CPUs in training, and a broken stage falls far below them (chance is 10%).
    assert train["test_accuracy"] > 0.94
    bench = read_json(tmp_path / "metrics/benchmark.json")
    assert bench["mac_reduction"] > 2.0
    # Tiny budgets (4 + 3 epochs on 6k samples, a [16, 32] CNN) do not recover fully; the README
    # records a properly budgeted run. Here: still a good classifier after pruning and INT8.
    assert bench["models"]["pruned_deployed"]["test_accuracy"] > 0.85
