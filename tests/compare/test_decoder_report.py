"""A decoder bench report's table of what quantisation alone gives (`pruneops.compare.decoder_report`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pruneops.compare.decoder_report import _dense_forms_lines, dense_forms, versus_form


def _change(value: float, low: float, high: float, unit: str = "perplexity") -> dict:
    return {"value": value, "low": low, "high": high, "unit": unit, "samples": 32}


def _candidate(runtime: str, precision: str, tpot: float, ttft: float, within: bool, **changes) -> dict:
    return {"runtime": runtime, "precision": precision, "vocabulary": None, "val_perplexity": 24.0,
            "tpot_b1_ms": tpot, "ttft_b1_ms": ttft, "within_budget": within, **changes}  # fmt: skip


@pytest.fixture
def dense_dirs(tmp_path):
    """A dense variant's kept metrics: its quantize stage measured four forms and shipped INT8 for dense."""
    zero = _change(0.0, 0.0, 0.0)
    candidates = {
        "fp32": _candidate("genai", "fp32", 16.0, 350.0, True, val_change=zero),
        "int8": _candidate("genai", "int8", 8.0, 330.0, True, val_change=_change(0.003, 0.002, 0.005)),
        "llamacpp q8_0": _candidate("llamacpp", "q8_0", 6.4, 470.0, True, val_change=_change(0.004, 0.002, 0.006)),
        "llamacpp q4_k_m": _candidate(
            "llamacpp", "q4_k_m", 6.4, 510.0, False, val_change=_change(0.05, 0.045, 0.055),
            zero_shot_change=_change(-2.5, -9.0, 3.5, "points"),
        ),
    }  # fmt: skip
    (tmp_path / "dense").mkdir()
    metrics = {"quantize": {"candidates": candidates, "fastest_dense": "int8"}}
    (tmp_path / "dense" / "metrics.json").write_text(json.dumps(metrics))
    return {"dense": tmp_path / "dense", "ours": tmp_path / "ours"}


WORKLOAD = SimpleNamespace(
    variants=[SimpleNamespace(name="dense", kind="dense"), SimpleNamespace(name="ours", kind="")]
)


def test_every_dense_form_is_listed_with_its_speed_up_over_dense_fp32_in_the_same_timing(dense_dirs):
    forms = {f["name"]: f for f in dense_forms(WORKLOAD, dense_dirs)}
    assert list(forms) == ["fp32", "int8", "llamacpp q8_0", "llamacpp q4_k_m"]
    assert forms["int8"]["speedup_b1"] == pytest.approx(2.0) and forms["llamacpp q8_0"]["speedup_b1"] == 2.5
    assert forms["llamacpp q8_0"]["ttft_vs_fp32"] == pytest.approx(470 / 350)
    assert [n for n, f in forms.items() if f["shipped"]] == ["int8"]
    lines = _dense_forms_lines(list(forms.values()))
    q4 = next(line for line in lines if line.startswith("| q4_k_m (llama.cpp)"))
    assert "| -2.50 pts [-9.00, +3.50] |" in q4 and "| 1.46× | 6.40 | 2.50× | no |" in q4
    assert next(line for line in lines if line.startswith("| int8 ")).endswith("| yes, ships for dense |")


def test_a_pick_is_compared_with_dense_q4_k_m_through_each_ones_speed_up_over_dense_fp32(dense_dirs):
    forms = dense_forms(WORKLOAD, dense_dirs)
    form, ratio = versus_form({"speedup_b1": 3.75}, forms)
    assert form["name"] == "llamacpp q4_k_m" and ratio == pytest.approx(3.75 / 2.5)
    assert versus_form({"speedup_b1": 3.75}, forms, "int4") is None


def test_without_a_dense_variant_there_is_no_table(dense_dirs):
    assert dense_forms(SimpleNamespace(variants=[SimpleNamespace(name="ours", kind="")]), dense_dirs) == []
    assert _dense_forms_lines([]) == []


def test_the_frontier_puts_general_text_beside_the_corpus_where_the_rows_have_it(tmp_path):
    import matplotlib.image

    from pruneops.compare.decoder_report import plot_decoder_bench

    rows = [
        {"family": "dense", "label": "dense", "precision": "fp32", "tpot_b1_ms": 18.0, "test_perplexity": 26.0,
         "general_perplexity": 62.0},
        {"family": "ours", "label": "ours", "precision": "int8", "tpot_b1_ms": 5.0, "test_perplexity": 28.0,
         "general_perplexity": 210.0},
    ]  # fmt: skip
    plot_decoder_bench(rows, "w", tmp_path / "both.png")
    corpus_only = [{k: v for k, v in r.items() if k != "general_perplexity"} for r in rows]
    plot_decoder_bench(corpus_only, "w", tmp_path / "a.png")
    both, one = matplotlib.image.imread(tmp_path / "both.png"), matplotlib.image.imread(tmp_path / "a.png")
    assert both.shape[0] == one.shape[0] and both.shape[1] == 2 * one.shape[1]  # a second panel, same height


@pytest.mark.parametrize(
    ("dense_ships", "says"),
    [
        (None, "(dense: the pruned model was outside the budget)"),  # a results file from before reasons were kept
        ("outside_budget", "(dense: the pruned model was outside the budget)"),
        ("not_faster", "(dense: no form of the pruned model within the budget was faster)"),
        ("slower_elsewhere", "(dense: the pruned model's forms within the budget were too slow in the other metric)"),
    ],
)
def test_a_deployed_row_that_backed_off_to_dense_says_why(dense_ships, says):
    from pruneops.compare.decoder_report import _name

    row = {"label": "ours 0.7", "precision": "int8", "deployed": True, "source": "dense", "family": "ours",
           "dense_ships": dense_ships}  # fmt: skip
    assert _name(row) == f"ours 0.7 int8, deployed {says}"
    assert _name({**row, "source": "pruned", "dense_ships": None}) == "ours 0.7 int8, deployed"
