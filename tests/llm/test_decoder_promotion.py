"""The decoder promotion rule: perplexity within a tolerance on every dataset, decode time within the SLO."""

from __future__ import annotations

import pytest

from pruneops.registry.promotion import DECODE_TIMING_NOISE, DecoderEvaluation, decide_decoder_promotion

PRODUCTION = DecoderEvaluation({"recent": 20.0, "holdout": 30.0}, tpot_ms_b1=10.0)
SLOWER = 10.0 * (1 + DECODE_TIMING_NOISE) + 0.1  # ms per token: beyond production's and its timing noise


@pytest.mark.parametrize(
    ("candidate", "tolerance", "slo", "promote"),
    [
        (DecoderEvaluation({"recent": 20.3, "holdout": 30.5}, 9.0), 0.02, None, True),  # +1.5 %, +1.7 %: within 2 %
        (DecoderEvaluation({"recent": 20.3, "holdout": 30.7}, 9.0), 0.02, None, False),  # holdout +2.3 %
        (DecoderEvaluation({"recent": 19.0, "holdout": 29.0}, SLOWER), 0.02, None, False),
        (DecoderEvaluation({"recent": 19.0, "holdout": 29.0}, 10.5), 0.02, None, True),  # within the timing noise
        (DecoderEvaluation({"recent": 19.0, "holdout": 29.0}, 10.5), 0.02, 10.2, False),  # the SLO replaces it
        (DecoderEvaluation({"recent": 19.0, "holdout": 29.0}, 12.0), 0.02, 20.0, True),
    ],
)  # fmt: skip
def test_a_candidate_is_promoted_only_within_every_bound(candidate, tolerance, slo, promote):
    decision = decide_decoder_promotion(candidate, PRODUCTION, tolerance, slo)
    assert decision.promote is promote, decision.reasons
    assert len(decision.reasons) == 3  # the time rule and one line per dataset


def test_the_first_decoder_is_judged_by_the_slo_alone():
    first = DecoderEvaluation({"recent": 99.0}, 5.0)
    assert decide_decoder_promotion(first, None, 0.02, 6.0).promote
    assert not decide_decoder_promotion(first, None, 0.02, 4.0).promote
    assert decide_decoder_promotion(first, None, 0.02, None).promote
