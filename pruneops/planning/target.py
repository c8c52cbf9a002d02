"""The prune target, resolved once: what was asked, and what planning and the gates aim at.

`prune.target` as loaded is never rewritten. What it becomes here is a typed value made in this
module alone: a `latency_ratio` of a reference model becomes a ratio of dense as timed now, an
`auto` form the form whose plan is cheapest (and its ratio of dense in that form), a causal LM's
`latency_ms` a fraction of dense's measured time. Planning, the gate, the closed loop and the
reports read the `ResolvedTarget`; the report records the config as loaded beside it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from pruneops.config import AUTO_FORM, PruneConfig
from pruneops.config.prune import TargetKind
from pruneops.core.errors import ConfigError


@dataclass(frozen=True)
class ResolvedTarget:
    """A target as planning reads it.

    Args:
        kind: The target's kind (None: a method that takes no target).
        asked: `prune.target.value` as set.
        value: What planning aims at, in `kind`'s unit: for `latency_ratio` a fraction of dense's
            time in `form` (of a reference, resolved to one of dense); for a causal LM always a
            fraction of dense's measured time in `metric`.
        form: The form latency is planned and gated in (`auto` resolved to one).
        batch: The batch the latency is at (latency kinds).
        metric: A causal LM's time: `decode` or `prefill` (None for a classifier).
        reference: `prune.target.reference`, made absolute (timed beside every plan).
        provenance: How it was resolved (the reference's timing, each form's plan), for the report.
    """

    kind: TargetKind | None
    asked: float | None
    value: float | None
    form: str = "fp32"
    batch: int | None = None
    metric: str | None = None
    reference: Path | None = None
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def is_latency(self) -> bool:
        """Whether it is a latency (`latency_ms` or `latency_ratio`)."""
        return self.kind in ("latency_ms", "latency_ratio")

    def aiming(self, **update: Any) -> ResolvedTarget:
        """The same target aimed otherwise (another form or value, as a form choice makes it)."""
        return replace(self, **update)

    def record(self) -> dict[str, Any]:
        """JSON-ready (what the prune report gives beside the config as loaded)."""
        out = asdict(self)
        out["reference"] = str(self.reference) if self.reference else None
        return out


def asked(config: PruneConfig) -> ResolvedTarget:
    """`prune.target` as set: before a reference is timed or a form chosen (`auto` planned in fp32)."""
    t = config.target
    if t is None:
        return ResolvedTarget(None, None, None)
    form = "fp32" if t.form == AUTO_FORM else t.form
    return ResolvedTarget(t.kind, t.value, t.value, form, t.batch, t.metric, t.reference_file)


def of_reference(config: PruneConfig, ratio_of_dense: float, record: dict[str, Any]) -> ResolvedTarget:
    """A ratio of a reference model's time resolved to a ratio of dense's (`record`: the timing behind it)."""
    file = Path(record["file"])
    return replace(asked(config), value=ratio_of_dense, reference=file, provenance={"reference": record})


def in_form(target: ResolvedTarget, form: str, value: float, choices: list[dict] | None = None) -> ResolvedTarget:
    """`target` planned in `form` at `value` (its ratio of dense in that form): what `auto` chose."""
    provenance = {**target.provenance, **({"forms": choices} if choices is not None else {})}
    return replace(target, form=form, value=value, provenance=provenance)


def decoder_ratio(config: PruneConfig, dense_ms: float) -> float:
    """A causal LM's target as a fraction of dense time: `latency_ratio` as set, `latency_ms` of dense's `dense_ms`.

    Raises:
        ConfigError: A `latency_ms` target that dense already meets (there is nothing to cut for).
    """
    target = config.target
    if target.kind == "latency_ratio":
        return target.value
    if target.value >= dense_ms:
        unit = "ms/token" if target.decoder_metric == "decode" else "ms to first token"
        raise ConfigError(
            f"prune.target.value: {target.value:g} {unit} is not below the dense model's "
            f"{dense_ms:.2f} (the latency stage's measurement): dense already meets it"
        )
    return target.value / dense_ms


def of_decoder(config: PruneConfig, dense_ms: float, reference: dict[str, Any] | None = None) -> ResolvedTarget:
    """A causal LM's target: a fraction of dense's measured time in its metric, or (a reference) the ratio timed."""
    base = replace(asked(config), metric=config.target.decoder_metric)
    if reference is not None:
        return replace(base, value=reference["planned_ratio_of_dense"], provenance={"reference": reference})
    return replace(base, value=decoder_ratio(config, dense_ms))
