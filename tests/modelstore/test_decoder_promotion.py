"""The decoder promotion rule: perplexity within a tolerance on every dataset, both latencies within their SLOs."""

from __future__ import annotations

import pytest

from pruneops.modelstore.promotion import DECODE_TIMING_NOISE, DecoderEvaluation, decide_decoder_promotion

PRODUCTION = DecoderEvaluation({"recent": 20.0, "holdout": 30.0}, tpot_ms_b1=10.0, ttft_ms_b1=500.0)
SLOWER = 1 + DECODE_TIMING_NOISE + 0.01  # a factor beyond production's time and its timing noise
WITHIN = 1 + DECODE_TIMING_NOISE - 0.02  # a factor within the timing noise


def _candidate(recent: float, holdout: float, tpot_ms: float, ttft_ms: float = 500.0) -> DecoderEvaluation:
    return DecoderEvaluation({"recent": recent, "holdout": holdout}, tpot_ms, ttft_ms)


@pytest.mark.parametrize(
    ("candidate", "tolerance", "slo", "promote"),
    [
        (_candidate(20.3, 30.5, 9.0), 0.02, None, True),  # +1.5 %, +1.7 %: within 2 %
        (_candidate(20.3, 30.7, 9.0), 0.02, None, False),  # holdout +2.3 %
        (_candidate(19.0, 29.0, 10.0 * SLOWER), 0.02, None, False),
        (_candidate(19.0, 29.0, 10.0 * WITHIN), 0.02, None, True),  # within the timing noise
        (_candidate(19.0, 29.0, 10.5), 0.02, 10.2, False),  # the SLO replaces it
        (_candidate(19.0, 29.0, 12.0), 0.02, 20.0, True),
        (_candidate(19.0, 29.0, 9.0, 500.0 * SLOWER), 0.02, None, False),  # decodes faster, prefills slower
        (_candidate(19.0, 29.0, 9.0, 500.0 * WITHIN), 0.02, None, True),
    ],
)  # fmt: skip
def test_a_candidate_is_promoted_only_within_every_bound(candidate, tolerance, slo, promote):
    decision = decide_decoder_promotion(candidate, PRODUCTION, tolerance, slo)
    assert decision.promote is promote, decision.reasons
    assert len(decision.reasons) == 4  # the two time rules and one line per dataset


def test_a_prefill_slo_replaces_the_comparison_with_production():
    slower_prefill = _candidate(19.0, 29.0, 9.0, 500.0 * SLOWER)
    assert decide_decoder_promotion(slower_prefill, PRODUCTION, 0.02, None, prefill_slo_ms=600.0).promote
    decision = decide_decoder_promotion(_candidate(19.0, 29.0, 9.0, 450.0), PRODUCTION, 0.02, None, 400.0)
    assert not decision.promote
    assert "time to first token 450.000 ms > SLO 400.0 ms" in decision.reasons


def test_the_first_decoder_is_judged_by_the_slos_alone():
    first = DecoderEvaluation({"recent": 99.0}, 5.0, 300.0)
    assert decide_decoder_promotion(first, None, 0.02, 6.0).promote
    assert not decide_decoder_promotion(first, None, 0.02, 4.0).promote
    assert decide_decoder_promotion(first, None, 0.02, None).promote
    assert not decide_decoder_promotion(first, None, 0.02, None, prefill_slo_ms=250.0).promote


@pytest.mark.parametrize("general", [True, False])
def test_a_re_pruned_decoder_is_scored_on_general_text_where_the_corpus_has_it(general, tmp_path):
    import numpy as np

    from pruneops.core.io import Layout
    from pruneops.modelstore.gate import decoder_datasets

    layout = Layout(tmp_path)
    layout.stage_dir("validate").mkdir(parents=True)
    blocks = {"test": np.ones((3, 8), np.int32), **({"general": np.full((2, 8), 7, np.int32)} if general else {})}
    np.savez(layout.stage_dir("validate") / "corpus.npz", **blocks)
    datasets = decoder_datasets(layout, np.zeros((4, 8), np.int64))
    assert list(datasets) == ["recent", "holdout", *(["general"] if general else [])]
    assert datasets["recent"].shape == (3, 8) and datasets["holdout"].shape == (4, 8)
    if general:
        np.testing.assert_array_equal(datasets["general"], 7)
    worse = DecoderEvaluation({"recent": 20.0, "holdout": 30.0, "general": 60.0}, 9.0, 500.0)
    production = DecoderEvaluation({"recent": 20.0, "holdout": 30.0, "general": 50.0}, 10.0, 500.0)
    assert not decide_decoder_promotion(worse, production, 0.02, None).promote  # +20 % on general text


def _answers(right: int, items: int = 60) -> tuple[bool, ...]:
    return tuple(i < right for i in range(items))


@pytest.mark.parametrize(
    ("candidate_right", "tolerance", "promote"),
    [
        (45, 3.0, True),  # the same items right: +0.00 pts [+0.00, +0.00]
        (44, 3.0, False),  # one item of 60 lost: -1.67 pts [-5.00, +0.00], the interval's far end beyond 3
        (44, 6.0, True),
        (30, 3.0, False),  # 15 items lost: -25 pts
        (30, None, True),  # not judged
    ],
)  # fmt: skip
def test_a_candidate_may_lose_at_most_the_zero_shot_tolerance_against_production(candidate_right, tolerance, promote):
    production = DecoderEvaluation({"recent": 20.0}, 10.0, 500.0, _answers(45))
    candidate = DecoderEvaluation({"recent": 20.0}, 9.0, 500.0, _answers(candidate_right))
    decision = decide_decoder_promotion(candidate, production, 0.02, None, zero_shot_tolerance=tolerance)
    assert decision.promote is promote
    assert any(reason.startswith("zero-shot") for reason in decision.reasons) is (tolerance is not None)


def test_zero_shot_is_judged_only_where_both_answered_the_check():
    production = DecoderEvaluation({"recent": 20.0}, 10.0, 500.0)
    candidate = DecoderEvaluation({"recent": 20.0}, 9.0, 500.0, _answers(0))
    assert decide_decoder_promotion(candidate, production, 0.02, None, zero_shot_tolerance=3.0).promote
