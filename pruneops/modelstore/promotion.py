"""The promotion gate: a candidate replaces production only when it is at least as good."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pruneops.core.quality import QualityBudget, accuracy_change
from pruneops.data.splits import Split
from pruneops.data.zero_shot import zero_shot_correct
from pruneops.runtimes import runtime_of
from pruneops.runtimes.onnxruntime.files import make_session, median_latency_ms, ort_accuracy


@dataclass(frozen=True)
class ModelEvaluation:
    """A model's accuracy per dataset and its batch-1 latency on this machine."""

    accuracy: dict[str, float]
    latency_ms_b1: float


@dataclass(frozen=True)
class PromotionDecision:
    """Whether to promote, and why (every rule that was checked)."""

    promote: bool
    reasons: list[str]
    candidate: ModelEvaluation | DecoderEvaluation
    production: ModelEvaluation | DecoderEvaluation | None
    accuracy_tolerance: float  # a decoder's: the perplexity tolerance (relative)
    latency_slo_ms: float | None  # a decoder's: ms per output token (None: relative to production)
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


def evaluate_onnx(model_path: Path, datasets: dict[str, Split], repeats: int = 200) -> ModelEvaluation:
    """Accuracy on each dataset and median batch-1 latency (one thread) of an ONNX model."""
    session = make_session(model_path, threads=1)
    accuracy = {name: ort_accuracy(session, d.x, d.y) for name, d in datasets.items() if len(d)}
    sample = next(d for d in datasets.values() if len(d)).head(1).x
    return ModelEvaluation(accuracy, median_latency_ms(session, sample, repeats))


def decide_promotion(
    candidate: ModelEvaluation,
    production: ModelEvaluation | None,
    accuracy_tolerance: float,
    latency_slo_ms: float,
) -> PromotionDecision:
    """Decides whether the candidate replaces production.

    It must meet the latency SLO and, on every dataset both were evaluated on, reach at least
    production's accuracy minus the tolerance. With no production model, the SLO alone decides.
    """
    reasons = []
    ok = candidate.latency_ms_b1 <= latency_slo_ms
    reasons.append(f"latency {candidate.latency_ms_b1:.4f} ms {'<=' if ok else '>'} SLO {latency_slo_ms} ms")
    if production is None:
        reasons.append("no production model yet")
    else:
        for name, prod_acc in production.accuracy.items():
            cand_acc = candidate.accuracy.get(name)
            if cand_acc is None:
                continue
            good = cand_acc >= prod_acc - accuracy_tolerance
            ok &= good
            reasons.append(
                f"{name} accuracy {100 * cand_acc:.2f}% {'>=' if good else '<'} production "
                f"{100 * prod_acc:.2f}% - {100 * accuracy_tolerance:.2f} pts"
            )
    return PromotionDecision(ok, reasons, candidate, production, accuracy_tolerance, latency_slo_ms)


# Two identical decoders timed interleaved (3 rounds, 256-token prompt, 2-core CPU): time to first
# token within 3 % of each other, time per output token mostly within 7 % (at worst 11 % apart). A
# candidate within this of production's time is taken as no slower; beyond it, it is refused, which
# can refuse an equally fast one (an SLO judges by an absolute bound instead).
DECODE_TIMING_NOISE = 0.07


@dataclass(frozen=True)
class DecoderEvaluation:
    """A decoder's perplexity per dataset (its own exported logits) and its times at batch 1.

    `ttft_ms_b1` is the time to the first token after the benchmark's prompt (prefill), `tpot_ms_b1`
    each further token's.
    """

    perplexity: dict[str, float]
    tpot_ms_b1: float
    ttft_ms_b1: float
    zero_shot_correct: tuple[bool, ...] = ()  # each item of the zero-shot check's reported half, right or not


def evaluate_decoders(
    folders: dict[str, Path],
    datasets: dict[str, np.ndarray],
    prompt_length: int,
    new_tokens: int,
    rounds: int,
    zero_shot: dict | None = None,
) -> dict[str, DecoderEvaluation]:
    """Scores each export folder (any decoder runtime's) on each set of blocks and times them interleaved at batch 1.

    With `zero_shot` (`validate`'s check), each also answers the check's reported half.
    """
    from pruneops.timing.generation import DecodeWorkload, time_together

    runtimes = {name: runtime_of(folder, "causal_lm") for name, folder in folders.items()}
    first = next(iter(folders))
    vocab = runtimes[first].open(folders[first]).vocab_size
    prompt = np.random.default_rng(0).integers(0, vocab, (1, prompt_length))
    workload = DecodeWorkload(prompt, new_tokens, rounds)
    timings = time_together({name: (runtimes[name], folder) for name, folder in folders.items()}, workload)
    return {
        name: DecoderEvaluation(
            {d: float(np.exp(runtimes[name].open(folder).losses(blocks).mean())) for d, blocks in datasets.items()},
            timings[name].tpot_ms,
            timings[name].ttft_ms,
            _answers(runtimes[name].open(folder), zero_shot),
        )
        for name, folder in folders.items()
    }


def _answers(opened: object, zero_shot: dict | None) -> tuple[bool, ...]:
    return () if zero_shot is None else tuple(bool(x) for x in zero_shot_correct(opened, zero_shot, "zero_shot"))


def _time_rule(what: str, candidate_ms: float, production_ms: float | None, slo_ms: float | None) -> tuple[bool, str]:
    """One latency rule: within the SLO, or (no SLO) no slower than production beyond the timing noise."""
    if slo_ms is not None:
        ok = candidate_ms <= slo_ms
        return ok, f"{what} {candidate_ms:.3f} ms {'<=' if ok else '>'} SLO {slo_ms} ms"
    if production_ms is None:
        return True, f"{what} {candidate_ms:.3f} ms: no SLO and no production model to compare"
    ok = candidate_ms <= production_ms * (1 + DECODE_TIMING_NOISE)
    return ok, (
        f"{what} {candidate_ms:.3f} ms {'<=' if ok else '>'} production {production_ms:.3f} "
        f"+ {100 * DECODE_TIMING_NOISE:.0f} % timing noise"
    )


def decide_decoder_promotion(
    candidate: DecoderEvaluation,
    production: DecoderEvaluation | None,
    perplexity_tolerance: float,
    decode_slo_ms: float | None,
    prefill_slo_ms: float | None = None,
    zero_shot_tolerance: float | None = None,
) -> PromotionDecision:
    """Whether a decoder candidate replaces production.

    Its time per output token must meet `decode_slo_ms` and its time to the first token
    `prefill_slo_ms` (each null: no slower than production's beyond `DECODE_TIMING_NOISE`), and on
    every dataset its perplexity must be at most production's times `1 + perplexity_tolerance`.
    Where both answered the zero-shot check, its accuracy may fall at most `zero_shot_tolerance`
    points below production's, judged at the far end of the paired 95 % interval (None: not judged).
    With no production model, the SLOs alone decide.
    """
    decode_ok, decode_reason = _time_rule(
        "time per output token", candidate.tpot_ms_b1, production.tpot_ms_b1 if production else None, decode_slo_ms
    )
    prefill_ok, prefill_reason = _time_rule(
        "time to first token", candidate.ttft_ms_b1, production.ttft_ms_b1 if production else None, prefill_slo_ms
    )
    ok, reasons = decode_ok and prefill_ok, [decode_reason, prefill_reason]
    if production is None:
        reasons.append("no production model yet")
    else:
        for name, prod_ppl in production.perplexity.items():
            cand_ppl = candidate.perplexity.get(name)
            if cand_ppl is None:
                continue
            good = cand_ppl <= prod_ppl * (1 + perplexity_tolerance)
            ok &= good
            reasons.append(
                f"{name} perplexity {cand_ppl:.3f} {'<=' if good else '>'} production {prod_ppl:.3f} "
                f"x (1 + {perplexity_tolerance})"
            )
        if zero_shot_tolerance is not None and candidate.zero_shot_correct and production.zero_shot_correct:
            change = accuracy_change(np.asarray(candidate.zero_shot_correct), np.asarray(production.zero_shot_correct))
            budget = QualityBudget(zero_shot_tolerance, "points")
            held = budget.holds(change)
            ok &= held
            state = f"{'within' if held else 'outside'} {budget.text()}"
            reasons.append(f"zero-shot {change.text()} against production ({change.samples} items): {state}")
    return PromotionDecision(
        ok,
        reasons,
        candidate,
        production,
        perplexity_tolerance,
        decode_slo_ms,
        extra={"task": "causal_lm", "prefill_slo_ms": prefill_slo_ms, "zero_shot_tolerance": zero_shot_tolerance},
    )
