"""`validate` stage: load, split and check the data; write splits and reference statistics."""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from sklearn.model_selection import train_test_split

from pruneops.config import ValidateConfig
from pruneops.core.errors import DataError
from pruneops.core.inputs import text_inputs
from pruneops.core.io import Layout, dump_json, staged_output_paths
from pruneops.data.drift import TEXT_FEATURE_GROUPS, text_drift_features
from pruneops.data.expectations import SuiteResult, digests, raise_if_failed, run_suite, run_text_suite
from pruneops.data.loaders import load_raw
from pruneops.data.splits import DataMeta, Split, save_split
from pruneops.data.text import (
    TextTable,
    choose_max_length,
    load_tokenizer,
    text_digests,
    text_reference_stats,
    token_lengths,
    tokenize,
    unknown_id,
)
from pruneops.pipeline.stages import StageReport

QUANTILE_LEVELS = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


@dataclass(frozen=True)
class ValidationReport(StageReport):
    """What `validate` found and wrote."""

    dataset: str
    n_train: int
    n_val: int
    n_test: int
    n_features: int
    num_classes: int
    duplicates_dropped: int
    expectations_evaluated: int
    expectations_failed: int
    data_dir: Path

    def summary(self) -> str:
        return (
            f"{self.dataset}: {self.n_train}/{self.n_val}/{self.n_test} train/val/test, "
            f"{self.expectations_evaluated} expectations passed -> {self.data_dir}"
        )


def _split(
    x: np.ndarray, y: np.ndarray, fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Seeded split, stratified whenever each class has at least two samples and each side room for every class.

    Raises:
        DataError: Too few samples to split.
    """
    classes, counts = np.unique(y, return_counts=True)
    held = int(np.ceil(fraction * len(y)))
    if len(y) < 2 or held < 1 or len(y) - held < 1:
        raise DataError(f"{len(y)} samples cannot be split {1 - fraction:.2f}/{fraction:.2f}: too few samples")
    ok = counts.min() >= 2 and min(held, len(y) - held) >= len(classes)
    xa, xb, ya, yb = train_test_split(x, y, test_size=fraction, random_state=seed, stratify=y if ok else None)
    return xa, ya, xb, yb


def feature_groups(input_shape: tuple[int, ...], feature_names: list[str] | None) -> dict:
    """Named groups of flat feature indices, for per-group drift: image rows, or table columns."""
    if len(input_shape) == 3:
        c, h, w = input_shape
        index = np.arange(c * h * w).reshape(c, h, w)
        return {f"row_{r:02d}": index[:, r, :].ravel().tolist() for r in range(h)}
    names = feature_names or [f"f{i}" for i in range(int(np.prod(input_shape)))]
    return {name: [i] for i, name in enumerate(names)}


def reference_stats(x: np.ndarray, y: np.ndarray, classes: list[int], bins: int, groups: dict) -> dict:
    """Per-feature quantiles and histograms of scaled training inputs, for drift detection."""
    flat = x.reshape(len(x), -1)
    n_features = flat.shape[1]
    idx = np.clip((flat * bins).astype(np.int64), 0, bins - 1)
    counts = np.zeros((n_features, bins), dtype=np.int64)
    np.add.at(counts, (np.broadcast_to(np.arange(n_features), idx.shape), idx), 1)
    class_freq = np.array([(y == c).mean() for c in classes])
    return {
        "n_samples": len(flat),
        "n_features": n_features,
        "bin_edges": np.linspace(0.0, 1.0, bins + 1),
        "quantile_levels": list(QUANTILE_LEVELS),
        "quantiles": np.quantile(flat, QUANTILE_LEVELS, axis=0).T.round(6),
        "histograms": (counts / len(flat)).round(6),
        "mean": flat.mean(axis=0).round(6),
        "std": flat.std(axis=0).round(6),
        "classes": classes,
        "class_frequencies": class_freq.round(6),
        "feature_groups": groups,
    }


def summary_markdown(config: ValidateConfig, suite: SuiteResult, report: dict) -> str:
    """A readable account of the run: the splits and each expectation's outcome."""
    lines = [
        f"# Data validation: {config.dataset}",
        "",
        f"- train / val / test: {report['n_train']} / {report['n_val']} / {report['n_test']}",
        f"- features: {report['n_features']}, classes: {report['num_classes']}",
        f"- exact duplicates dropped before splitting: {report['duplicates_dropped']}",
        f"- expectations: {len(suite.outcomes)} evaluated, {len(suite.failed)} failed",
        "",
        "| batch | expectation | column | result | observed |",
        "|---|---|---|---|---|",
    ]
    for o in suite.outcomes:
        mark = "pass" if o.success else "**FAIL**"
        lines.append(f"| {o.batch} | {o.expectation} | {o.column or ''} | {mark} | {o.observed} |")
    return "\n".join(lines) + "\n"


def _write_outputs(
    layout: Layout,
    splits: dict[str, Split],
    meta: DataMeta,
    stats: dict,
    suite: SuiteResult,
    report: ValidationReport,
    markdown: str,
    copies: dict[str, Path] | None = None,
) -> None:
    """Writes splits, metadata, statistics, the validation report and `copies`, all or nothing."""
    out_dir, metrics_path = layout.stage_dir("validate"), layout.metrics("validate")
    with staged_output_paths(out_dir, metrics_path) as staged:
        tmp = staged.dir(out_dir)
        for name, split in splits.items():
            save_split(split, tmp / f"{name}.npz")
        meta.save(tmp / "meta.json")
        dump_json(stats, tmp / "reference_stats.json")
        dump_json(
            {"success": True, "report": report.metrics(), "outcomes": [asdict(o) for o in suite.outcomes]},
            tmp / "validation.json",
        )
        (tmp / "validation.md").write_text(markdown)
        for name, source in (copies or {}).items():
            shutil.copyfile(source, tmp / name)
        dump_json(report.metrics(), staged.path(metrics_path))


def _dedupe_texts(table: TextTable) -> tuple[list[str], np.ndarray, int]:
    """The texts with repeats of an earlier normalised text dropped, and how many were."""
    keep = np.unique(text_digests(table.texts), return_index=True)[1]
    keep.sort()
    return [table.texts[i] for i in keep], table.labels[keep], len(table.texts) - len(keep)


def validate_text(config: ValidateConfig, table: TextTable, layout: Layout) -> ValidationReport:
    """The `text` path of `validate`: dedupe, split, check, tokenise, write named-array splits.

    The tokenizer file is copied beside the splits (`tokenizer.json`), so the data and what
    tokenised it travel together; `max_length` defaults to the p95 token length of the training
    texts, rounded up to 8.

    Raises:
        DataValidationError: An expectation failed; nothing is written.
    """
    texts, labels, duplicates = _dedupe_texts(table) if config.drop_duplicates else (table.texts, table.labels, 0)
    order = np.arange(len(texts))
    i_pool, y_pool, i_test, y_test = _split(order, labels, config.test_fraction, config.seed)
    pick = lambda idx: [texts[i] for i in idx]  # noqa: E731
    classes = config.classes or sorted(int(c) for c in np.unique(y_pool))
    suite = run_text_suite(
        train=(pick(i_pool), y_pool),
        test=(pick(i_test), y_test),
        classes=classes,
        text_length=(config.min_text_chars, config.max_text_chars),
        min_samples_per_class=config.min_samples_per_class,
        max_leakage_fraction=config.max_leakage_fraction,
        max_duplicate_fraction=config.max_duplicate_fraction,
        max_class_imbalance=config.max_class_imbalance,
    )
    raise_if_failed(suite)
    i_train, y_train, i_val, y_val = _split(i_pool, y_pool, config.val_fraction, config.seed)
    if config.max_train_samples and len(y_train) > config.max_train_samples:
        i_train, y_train, _, _ = _split(i_train, y_train, 1.0 - config.max_train_samples / len(y_train), config.seed)

    tokenizer = load_tokenizer(config.tokenizer)
    lengths = token_lengths(tokenizer, pick(i_train))
    max_length = config.max_length or choose_max_length(lengths)
    splits = {
        name: Split(tokenize(tokenizer, pick(idx), max_length), y)
        for name, idx, y in (("train", i_train, y_train), ("val", i_val, y_val), ("test", i_test, y_test))
    }
    specs = [s.to_dict() for s in text_inputs()]
    truncated = float((lengths > max_length).mean())
    meta = DataMeta(
        dataset=config.dataset,
        input_shape=[max_length],
        num_classes=max(classes) + 1,
        classes=classes,
        value_range=[0.0, float(tokenizer.get_vocab_size())],
        class_names=table.label_names,
        inputs=specs,
        text={
            "tokenizer": "tokenizer.json",
            "max_length": max_length,
            "truncated_fraction": round(truncated, 6),
            "dropped_rows": table.dropped,
        },
    )
    train, unk = splits["train"].x, unknown_id(tokenizer)
    features = text_drift_features(train["input_ids"], train["attention_mask"], max_length, unk)
    stats = {
        **reference_stats(features, y_train, classes, config.hist_bins, TEXT_FEATURE_GROUPS),
        **text_reference_stats(train["input_ids"], train["attention_mask"], lengths, unk),
        "max_length": max_length,
    }
    report = ValidationReport(
        dataset=config.dataset,
        n_train=len(y_train),
        n_val=len(y_val),
        n_test=len(y_test),
        n_features=max_length,
        num_classes=meta.num_classes,
        duplicates_dropped=duplicates,
        expectations_evaluated=len(suite.outcomes),
        expectations_failed=0,
        data_dir=layout.stage_dir("validate"),
    )
    markdown = summary_markdown(config, suite, report.metrics())
    markdown += (
        f"\n- max_length {max_length} tokens ({truncated:.1%} of training texts truncated); "
        f"labels: {table.label_names or classes}; rows dropped: {table.dropped}\n"
    )
    source = Path(config.tokenizer)
    source = source / "tokenizer.json" if source.is_dir() else source
    _write_outputs(layout, splits, meta, stats, suite, report, markdown, {"tokenizer.json": source})
    return report


def validate_dataset(config: ValidateConfig, layout: Layout | None = None) -> ValidationReport:
    """Loads the configured data, splits it (seeded), validates it and writes the splits.

    Args:
        config: The `validate` section of params.
        layout: Where to write; defaults to the current directory.

    Returns:
        The report; the splits, metadata, reference statistics and the validation report are
        under `artifacts/validate/`.

    Raises:
        DataError: The source is missing or unreadable.
        DataValidationError: An expectation failed; nothing is written.
    """
    layout = layout or Layout()
    raw = load_raw(config)
    if isinstance(raw, TextTable):
        return validate_text(config, raw, layout)
    value_range = tuple(config.value_range) if config.value_range else raw.value_range

    duplicates = 0
    if raw.x_test is None:
        keep = np.unique(digests(raw.x_train), return_index=True)[1]
        keep.sort()
        duplicates = len(raw.x_train) - len(keep)
        x_pool, y_pool, x_test, y_test = _split(raw.x_train[keep], raw.y_train[keep], config.test_fraction, config.seed)
    else:
        x_pool, y_pool, x_test, y_test = raw.x_train, raw.y_train, raw.x_test, raw.y_test

    classes = config.classes or sorted(int(c) for c in np.unique(y_pool) if c >= 0)
    table_columns = None
    if raw.table is not None:
        table_columns = [*(config.feature_columns or raw.feature_names), config.label_column]
    suite = run_suite(
        train=(x_pool, y_pool),
        test=(x_test, y_test),
        classes=classes,
        value_range=value_range,
        min_samples_per_class=config.min_samples_per_class,
        max_leakage_fraction=config.max_leakage_fraction,
        table=raw.table,
        table_columns=table_columns,
        max_class_imbalance=config.max_class_imbalance,
    )
    raise_if_failed(suite)

    x_train, y_train, x_val, y_val = _split(x_pool, y_pool, config.val_fraction, config.seed)
    if config.max_train_samples and len(y_train) > config.max_train_samples:
        x_train, y_train, _, _ = _split(x_train, y_train, 1.0 - config.max_train_samples / len(y_train), config.seed)

    low, high = value_range

    def scale(x: np.ndarray) -> np.ndarray:
        return ((x - low) / (high - low)).astype(np.float32)

    splits = {
        "train": Split(scale(x_train), y_train),
        "val": Split(scale(x_val), y_val),
        "test": Split(scale(x_test), y_test),
    }
    meta = DataMeta(
        dataset=config.dataset,
        input_shape=list(raw.input_shape),
        num_classes=max(classes) + 1,
        classes=classes,
        value_range=[float(low), float(high)],
        feature_names=raw.feature_names,
        class_names=raw.class_names,
    )
    groups = feature_groups(raw.input_shape, raw.feature_names)
    stats = reference_stats(splits["train"].x, y_train, classes, config.hist_bins, groups)
    report = ValidationReport(
        dataset=config.dataset,
        n_train=len(y_train),
        n_val=len(y_val),
        n_test=len(y_test),
        n_features=int(np.prod(raw.input_shape)),
        num_classes=meta.num_classes,
        duplicates_dropped=duplicates,
        expectations_evaluated=len(suite.outcomes),
        expectations_failed=0,
        data_dir=layout.stage_dir("validate"),
    )
    _write_outputs(layout, splits, meta, stats, suite, report, summary_markdown(config, suite, report.metrics()))
    return report
