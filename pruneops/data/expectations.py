"""The Great Expectations 1.x suite run by `validate`, in an in-memory (ephemeral) context.

Images can have hundreds of features, so rather than one expectation per pixel the suite runs
over a per-sample table (min, max, non-finite count, feature count, label, content digest) plus a
per-class count table; tabular sources also get their raw schema and nulls checked per column.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from pruneops.core.errors import DataValidationError


@dataclass(frozen=True)
class ExpectationOutcome:
    """One evaluated expectation."""

    batch: str
    expectation: str
    column: str | None
    success: bool
    observed: str


@dataclass
class SuiteResult:
    """All outcomes of the suite."""

    outcomes: list[ExpectationOutcome] = field(default_factory=list)

    @property
    def failed(self) -> list[ExpectationOutcome]:
        """The outcomes that did not hold."""
        return [o for o in self.outcomes if not o.success]

    @property
    def success(self) -> bool:
        """True when every expectation held."""
        return not self.failed


def raise_if_failed(suite: SuiteResult) -> None:
    """Raises `DataValidationError` naming the failed expectations, if any."""
    if suite.success:
        return
    failed = suite.failed
    names = ", ".join(f"{o.expectation}({o.column or o.batch})" for o in failed[:4])
    details = [f"  {o.batch}: {o.expectation} {o.column or ''}: {o.observed}" for o in failed]
    raise DataValidationError(
        f"data validation failed: {len(failed)} of {len(suite.outcomes)} expectations "
        f"failed: {names}{' ...' if len(failed) > 4 else ''}",
        details,
    )


def digests(x: np.ndarray) -> np.ndarray:
    """Content hash per sample (exact duplicates share a digest)."""
    flat = np.ascontiguousarray(x.reshape(len(x), -1))
    return np.array([hashlib.blake2b(row.tobytes(), digest_size=12).hexdigest() for row in flat])


def sample_table(x: np.ndarray, y: np.ndarray, split: str) -> pd.DataFrame:
    """One row per sample: what the per-sample expectations look at."""
    flat = x.reshape(len(x), -1)
    finite = np.isfinite(flat)
    with np.errstate(invalid="ignore"):
        x_min = np.where(finite, flat, np.inf).min(axis=1)
        x_max = np.where(finite, flat, -np.inf).max(axis=1)
    return pd.DataFrame(
        {
            "split": split,
            "label": y,
            "n_features": flat.shape[1],
            "n_nonfinite": (~finite).sum(axis=1),
            "x_min": np.where(np.isfinite(x_min), x_min, np.nan),
            "x_max": np.where(np.isfinite(x_max), x_max, np.nan),
        }
    )


def _observed(result: dict) -> str:
    if "observed_value" in result:
        return str(result["observed_value"])[:120]
    if "unexpected_count" in result:
        examples = result.get("partial_unexpected_list", [])[:5]
        return f"{result['unexpected_count']} unexpected, e.g. {examples}"
    return ""


def run_suite(
    *,
    train: tuple[np.ndarray, np.ndarray],
    test: tuple[np.ndarray, np.ndarray],
    classes: list[int],
    value_range: tuple[float, float],
    min_samples_per_class: int,
    max_leakage_fraction: float,
    table: pd.DataFrame | None = None,
    table_columns: list[str] | None = None,
    max_class_imbalance: float | None = None,
) -> SuiteResult:
    """Runs the data suite and returns every outcome (never raises on failing data).

    Args:
        train: Training inputs and labels (before scaling).
        test: Test inputs and labels.
        classes: The declared label set.
        value_range: Allowed [low, high] of every input value.
        min_samples_per_class: Fewest training samples any declared class may have.
        max_leakage_fraction: Largest allowed fraction of test samples also found in train.
        table: The raw table of tabular sources, for schema and per-column null checks.
        table_columns: The expected columns of `table` (features then label).
        max_class_imbalance: Largest allowed ratio of the biggest class's training count to any
            declared class's (None: not checked).
    """
    gxe = _gx_expectations()
    low, high = value_range

    samples = pd.concat([sample_table(*train, "train"), sample_table(*test, "test")])
    n_features = int(np.prod(train[0].shape[1:]))
    class_counts, balance_floor = _class_counts(train[1], classes, min_samples_per_class, max_class_imbalance)
    # Membership is precomputed: GX copies a large value_set on every metric it resolves.
    train_digests = set(digests(train[0]).tolist())
    test_rows = pd.DataFrame({"in_train": [d in train_digests for d in digests(test[0])]})

    batches: dict[str, tuple[pd.DataFrame, list]] = {
        "samples": (
            samples,
            [
                gxe.ExpectColumnValuesToBeInSet(column="n_features", value_set=[n_features]),
                gxe.ExpectColumnValuesToBeBetween(column="n_nonfinite", min_value=0, max_value=0),
                gxe.ExpectColumnValuesToNotBeNull(column="x_min"),
                gxe.ExpectColumnValuesToBeBetween(column="x_min", min_value=low),
                gxe.ExpectColumnValuesToBeBetween(column="x_max", max_value=high),
                gxe.ExpectColumnValuesToNotBeNull(column="label"),
                gxe.ExpectColumnValuesToBeInSet(column="label", value_set=classes),
            ],
        ),
        "class_counts": (
            class_counts,
            [
                gxe.ExpectColumnValuesToBeBetween(column="count", min_value=balance_floor),
                gxe.ExpectColumnUniqueValueCountToBeBetween(column="label", min_value=2),  # a classifier needs two
            ],
        ),
        "test_leakage": (
            test_rows,
            [
                gxe.ExpectColumnValuesToBeInSet(
                    column="in_train", value_set=[False], mostly=max(1.0 - max_leakage_fraction, 1e-9)
                )
            ],
        ),
    }
    if table is not None and table_columns is not None:
        table_checks: list = [gxe.ExpectTableColumnsToMatchSet(column_set=table_columns)]
        table_checks += [gxe.ExpectColumnValuesToNotBeNull(column=c) for c in table_columns if c in table]
        batches["raw_table"] = (table, table_checks)

    return evaluate(batches)


def _gx_expectations():
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    logging.getLogger("great_expectations").setLevel(logging.ERROR)
    import great_expectations.expectations as gxe

    return gxe


def _class_counts(
    y: np.ndarray, classes: list[int], min_samples_per_class: int, max_class_imbalance: float | None
) -> tuple[pd.DataFrame, int]:
    """Training samples per declared class, and the fewest each must have."""
    counts = pd.Series(y).value_counts()
    class_counts = pd.DataFrame({"label": classes, "count": [int(counts.get(c, 0)) for c in classes]})
    floor = min_samples_per_class
    if max_class_imbalance is not None:  # every class holds at least biggest / ratio samples
        floor = max(floor, int(np.ceil(class_counts["count"].max() / max_class_imbalance)))
    return class_counts, floor


def evaluate(batches: dict[str, tuple[pd.DataFrame, list]]) -> SuiteResult:
    """Runs each frame's expectations in an ephemeral Great Expectations context."""
    _gx_expectations()
    import great_expectations as gx

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = {"globally": False}
    source = context.data_sources.add_pandas("pruneops")
    result = SuiteResult()
    for name, (frame, expectations) in batches.items():
        asset = source.add_dataframe_asset(name=name)
        batch_def = asset.add_batch_definition_whole_dataframe(f"{name}_all")
        suite = context.suites.add(gx.ExpectationSuite(name=f"pruneops_{name}"))
        for expectation in expectations:
            suite.add_expectation(expectation)
        batch = batch_def.get_batch(batch_parameters={"dataframe": frame})
        validation = batch.validate(suite)
        for r in validation.results:
            cfg = r.expectation_config
            result.outcomes.append(
                ExpectationOutcome(
                    batch=name,
                    expectation=cfg.type,
                    column=cfg.kwargs.get("column"),
                    success=bool(r.success),
                    observed=_observed(r.result or {}),
                )
            )
    return result


def run_text_suite(
    *,
    train: tuple[list[str], np.ndarray],
    test: tuple[list[str], np.ndarray],
    classes: list[int],
    text_length: tuple[int, int],
    min_samples_per_class: int,
    max_leakage_fraction: float,
    max_duplicate_fraction: float,
    max_class_imbalance: float | None = None,
) -> SuiteResult:
    """The text suite, run by `validate` on `dataset: text` (never raises on failing data).

    Checks non-empty text within length bounds, the label set, samples per class, duplicates
    within train and train/test leakage, both on normalised text.

    Args:
        train: Training texts and labels.
        test: Test texts and labels.
        classes: The declared label set.
        text_length: Allowed [fewest, most] characters of a text after stripping.
        min_samples_per_class: Fewest training samples any declared class may have.
        max_leakage_fraction: Largest allowed fraction of test texts also found in train.
        max_duplicate_fraction: Largest allowed fraction of training texts that repeat another.
        max_class_imbalance: Largest allowed ratio of the biggest class to any declared class.
    """
    from pruneops.data.text import text_digests

    gxe = _gx_expectations()
    rows = []
    for split, (texts, y) in (("train", train), ("test", test)):
        rows.append(pd.DataFrame({"split": split, "label": y, "n_chars": [len(t.strip()) for t in texts]}))
    samples = pd.concat(rows)
    class_counts, floor = _class_counts(train[1], classes, min_samples_per_class, max_class_imbalance)
    train_digests = text_digests(train[0])
    seen = set(train_digests.tolist())
    repeats = pd.Series(train_digests).duplicated().to_numpy()
    batches = {
        "text_samples": (
            samples,
            [
                gxe.ExpectColumnValuesToBeBetween(column="n_chars", min_value=max(text_length[0], 1)),
                gxe.ExpectColumnValuesToBeBetween(column="n_chars", max_value=text_length[1]),
                gxe.ExpectColumnValuesToNotBeNull(column="label"),
                gxe.ExpectColumnValuesToBeInSet(column="label", value_set=classes),
            ],
        ),
        "class_counts": (
            class_counts,
            [
                gxe.ExpectColumnValuesToBeBetween(column="count", min_value=floor),
                gxe.ExpectColumnUniqueValueCountToBeBetween(column="label", min_value=2),
            ],
        ),
        "train_duplicates": (
            pd.DataFrame({"repeats_earlier": repeats}),
            [
                gxe.ExpectColumnValuesToBeInSet(
                    column="repeats_earlier", value_set=[False], mostly=max(1.0 - max_duplicate_fraction, 1e-9)
                )
            ],
        ),
        "test_leakage": (
            pd.DataFrame({"in_train": [d in seen for d in text_digests(test[0])]}),
            [
                gxe.ExpectColumnValuesToBeInSet(
                    column="in_train", value_set=[False], mostly=max(1.0 - max_leakage_fraction, 1e-9)
                )
            ],
        ),
    }
    return evaluate(batches)


def run_corpus_suite(
    *,
    splits: dict[str, list[str]],
    blocks: dict[str, np.ndarray],
    text_length: tuple[int, int],
    max_duplicate_fraction: float,
    max_leakage_fraction: float,
    unknown_id: int | None,
    max_unknown_token_rate: float,
) -> SuiteResult:
    """The text-corpus suite, run by `validate` on `dataset: corpus` (never raises on failing data).

    Checks every document's length within bounds, repeated documents within train, test documents
    found in train (whitespace and case ignored), a whole block in every split, and the share of
    training tokens the tokenizer maps to its unknown token.

    Args:
        splits: Documents per split (train, val, test).
        blocks: Token blocks per split.
        text_length: Allowed [fewest, most] characters of a document after stripping.
        max_duplicate_fraction: Largest allowed fraction of training documents that repeat another.
        max_leakage_fraction: Largest allowed fraction of test documents also found in train.
        unknown_id: The tokenizer's unknown token (None: it has none; the check is vacuous).
        max_unknown_token_rate: Largest allowed fraction of unknown training tokens.
    """
    from pruneops.data.text import text_digests

    gxe = _gx_expectations()
    documents = pd.concat(
        pd.DataFrame({"split": name, "n_chars": [len(d.strip()) for d in docs]}) for name, docs in splits.items()
    )
    train_digests = text_digests(splits["train"])
    seen = set(train_digests.tolist())
    tokens = blocks["train"].ravel()
    unknown = tokens == unknown_id if unknown_id is not None else np.zeros(len(tokens), dtype=bool)
    batches = {
        "corpus_documents": (
            documents,
            [
                gxe.ExpectColumnValuesToBeBetween(column="n_chars", min_value=max(text_length[0], 1)),
                gxe.ExpectColumnValuesToBeBetween(column="n_chars", max_value=text_length[1]),
            ],
        ),
        "corpus_blocks": (
            pd.DataFrame({"split": list(blocks), "blocks": [len(b) for b in blocks.values()]}),
            [gxe.ExpectColumnValuesToBeBetween(column="blocks", min_value=1)],
        ),
        "corpus_duplicates": (
            pd.DataFrame({"repeats_earlier": pd.Series(train_digests).duplicated().to_numpy()}),
            [
                gxe.ExpectColumnValuesToBeInSet(
                    column="repeats_earlier", value_set=[False], mostly=max(1.0 - max_duplicate_fraction, 1e-9)
                )
            ],
        ),
        "corpus_leakage": (
            pd.DataFrame({"in_train": [d in seen for d in text_digests(splits["test"])]}),
            [
                gxe.ExpectColumnValuesToBeInSet(
                    column="in_train", value_set=[False], mostly=max(1.0 - max_leakage_fraction, 1e-9)
                )
            ],
        ),
        "corpus_tokens": (
            pd.DataFrame({"unknown": unknown}),
            [
                gxe.ExpectColumnValuesToBeInSet(
                    column="unknown", value_set=[False], mostly=max(1.0 - max_unknown_token_rate, 1e-9)
                )
            ],
        ),
    }
    return evaluate(batches)
