"""The promotion gate: a candidate replaces production only when it is at least as good."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from pruneops.data.splits import Split
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
    candidate: ModelEvaluation
    production: ModelEvaluation | None
    accuracy_tolerance: float
    latency_slo_ms: float
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
