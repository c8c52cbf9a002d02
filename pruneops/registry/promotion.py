"""The promotion gate: a candidate replaces production only when it is at least as good."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pruneops.data.splits import Split
from pruneops.io import read_json
from pruneops.onnx_utils import make_session, median_latency_ms, ort_accuracy


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


# Interleaved timings of two identical decoders differ by up to ~7 % on a 2-core CPU: a candidate
# within this of production's time per token is not slower.
DECODE_TIMING_NOISE = 0.07


@dataclass(frozen=True)
class DecoderEvaluation:
    """A decoder's perplexity per dataset (its own exported logits) and time per output token at batch 1."""

    perplexity: dict[str, float]
    tpot_ms_b1: float


def evaluate_decoders(
    folders: dict[str, Path], datasets: dict[str, np.ndarray], prompt_length: int, new_tokens: int, rounds: int
) -> dict[str, DecoderEvaluation]:
    """Scores each genai folder on each set of token blocks and times them interleaved at batch 1."""
    from pruneops.timing.decode import exported_block_losses, time_generation

    vocab = int(read_json(next(iter(folders.values())) / "genai_config.json")["model"]["vocab_size"])
    prompt = np.random.default_rng(0).integers(0, vocab, (1, prompt_length))
    timings = time_generation(folders, prompt, new_tokens, rounds)
    return {
        name: DecoderEvaluation(
            {d: float(np.exp(exported_block_losses(folder, blocks).mean())) for d, blocks in datasets.items()},
            timings[name].tpot_ms,
        )
        for name, folder in folders.items()
    }


def decide_decoder_promotion(
    candidate: DecoderEvaluation,
    production: DecoderEvaluation | None,
    perplexity_tolerance: float,
    decode_slo_ms: float | None,
) -> PromotionDecision:
    """Whether a decoder candidate replaces production.

    Its time per output token must meet `decode_slo_ms` (null: no slower than production's beyond
    `DECODE_TIMING_NOISE`), and on every dataset its perplexity must be at most production's times
    `1 + perplexity_tolerance`. With no production model, the SLO alone decides.
    """
    reasons, ok = [], True
    if decode_slo_ms is not None:
        ok = candidate.tpot_ms_b1 <= decode_slo_ms
        reasons.append(f"{candidate.tpot_ms_b1:.3f} ms/token {'<=' if ok else '>'} SLO {decode_slo_ms} ms")
    elif production is not None:
        ceiling = production.tpot_ms_b1 * (1 + DECODE_TIMING_NOISE)
        ok = candidate.tpot_ms_b1 <= ceiling
        reasons.append(
            f"{candidate.tpot_ms_b1:.3f} ms/token {'<=' if ok else '>'} production {production.tpot_ms_b1:.3f} "
            f"+ {100 * DECODE_TIMING_NOISE:.0f} % timing noise"
        )
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
    return PromotionDecision(
        ok,
        reasons,
        candidate,
        production,
        perplexity_tolerance,
        decode_slo_ms,
        extra={"task": "causal_lm"},
    )
