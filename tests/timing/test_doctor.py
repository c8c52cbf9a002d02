"""`pruneops doctor`: this machine's timing noise and drift, and how well the latency table predicts, judged."""

from __future__ import annotations

import json

from pruneops.cli import main
from pruneops.core.io import Layout
from pruneops.timing.doctor import PREDICTION_TOLERANCE, check_fit, check_noise, reference_model


def test_identical_sessions_are_timed_side_by_side_and_their_spread_and_drift_judged(tmp_path):
    model = reference_model(Layout(tmp_path), tmp_path)  # no export here: the stand-in MLP
    noise, drift = check_noise(model, sessions=2, passes=2, calls=20)
    assert (noise.check, drift.check) == ("noise", "drift")
    spread = float(noise.text.split("differ by up to ")[1].split(" %")[0]) / 100
    assert noise.ok == (spread <= 0.01) and spread >= 0.0


def test_a_latency_table_off_by_more_than_its_tolerance_is_a_warning(tmp_path):
    layout = Layout(tmp_path)
    layout.metrics("latency").parent.mkdir(parents=True)
    fit = {"predictor": "table", "mean_held_out_error": {"table": PREDICTION_TOLERANCE + 0.01, "line": 0.02}}
    layout.metrics("latency").write_text(json.dumps({"predictors": {"fp32": {"1": fit}}}))
    layout.metrics("prune").write_text(json.dumps({"latency_prediction_error": -0.05}))
    table, prediction = check_fit(layout)
    assert not table.ok and "table predictor is off by 16.0 %" in table.text
    assert prediction.ok and "-5.0 %" in prediction.text


def test_the_command_reads_a_project_and_prints_every_check(pipeline_dir, capsys):
    assert main(["--root", str(pipeline_dir), "doctor", "--passes", "2"]) == 0
    out = capsys.readouterr().out
    for check in ("machine", "noise", "drift"):
        assert f" {check}: " in out
    assert "dense_fp32.onnx" in out  # the project's own export is what is timed
