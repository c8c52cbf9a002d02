"""`validate` for a causal LM: the corpus read, split by document, checked and cut into token blocks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pruneops.config import ValidateConfig
from pruneops.core.errors import DataError
from pruneops.core.io import Layout, dump_json, staged_output_paths
from pruneops.data.corpus import affixes_of, hf_encode, read_documents, read_labelled, split_documents, to_blocks
from pruneops.data.drift import prompt_reference
from pruneops.data.expectations import raise_if_failed, run_corpus_suite
from pruneops.data.text import text_digests
from pruneops.data.zero_shot import ZERO_SHOT_FILE, ZERO_SHOT_SPLITS
from pruneops.models.decoders import load_causal_tokenizer
from pruneops.pipeline.stages import StageReport
from pruneops.task.causal_lm.common import CORPUS_FILE, REFERENCE_FILE


@dataclass(frozen=True)
class CorpusReport(StageReport):
    """What `validate` found in a corpus and wrote."""

    dataset: str
    documents: dict
    tokens: dict
    blocks: dict
    block_length: int
    duplicates_dropped: int
    expectations_evaluated: int
    expectations_failed: int
    data_dir: Path

    def summary(self) -> str:
        b = self.blocks
        return (
            f"corpus: {b['train']}/{b['val']}/{b['test']} blocks of {self.block_length} tokens (train/val/test), "
            f"{self.expectations_evaluated} expectations passed -> {self.data_dir}"
        )


def _drop_repeats(documents: list[str]) -> tuple[list[str], int]:
    digests = text_digests(documents)
    seen: set[str] = set()
    kept = []
    for document, digest in zip(documents, digests, strict=True):
        if digest not in seen:
            seen.add(digest)
            kept.append(document)
    return kept, len(documents) - len(kept)


GENERAL_SPLITS = ("general_val", "general")  # the budget's half, the benchmark's half


def _general_halves(config: ValidateConfig, tokenizer: object) -> dict[str, np.ndarray]:
    """The general text's blocks in two halves: documents alternate, each half capped at `general_blocks`.

    `general_val` is what `quantize` holds to `prune.gate.max_general_perplexity_increase`;
    `general`, what the benchmark reports, so a model is judged on other text than it was chosen on.

    Raises:
        DataError: The general text gives fewer than two blocks a half.
    """
    documents = read_documents(config.general_text, config.text_column, config.encoding)
    halves = {}
    for offset, name in enumerate(GENERAL_SPLITS):
        part = documents[offset::2] if len(documents) > 1 else []
        halves[name] = to_blocks(part, tokenizer, config.block_length)[0][: config.general_blocks]
    if len(documents) == 1:  # one long text: its blocks alternate instead
        every, _ = to_blocks(documents, tokenizer, config.block_length)
        halves = {name: every[offset::2][: config.general_blocks] for offset, name in enumerate(GENERAL_SPLITS)}
    short = [name for name, b in halves.items() if len(b) < 2]
    if short:
        raise DataError(
            f"validate.general_text: {config.general_text} gives fewer than 2 blocks of {config.block_length} "
            f"tokens for {short[0]} (it is halved: one half gates, the other is reported); give a longer text"
        )
    return halves


def _zero_shot_items(config: ValidateConfig, tokenizer: object) -> dict:
    """The zero-shot check tokenised as the model reads it: each item's context, each label's tokens, the answer.

    The context is the tokenizer's own prefix (a BOS where it adds one) and the prompt with the
    text; a label follows it after one space. A file with more than `zero_shot_items` items gives
    that many, drawn with `seed` across it. Items alternate between `zero_shot_val` (what
    `quantize` holds to `prune.gate.max_zero_shot_drop`) and `zero_shot` (what the benchmark reports).

    Raises:
        DataError: A label outside `zero_shot_labels`, fewer than two labels, or fewer than two items a half.
    """
    items = read_labelled(config.zero_shot, config.text_column, config.zero_shot_label_column)
    if len(items) > config.zero_shot_items:  # drawn across the file (seeded), in its order: one sorted by label
        drawn = np.random.default_rng(config.seed).choice(len(items), config.zero_shot_items, replace=False)
        items = [items[i] for i in sorted(drawn)]  # still gives every label
    labels = list(config.zero_shot_labels or sorted({label for _, label in items}))
    unknown = sorted({label for _, label in items} - set(labels))
    if unknown or len(labels) < 2:
        what = f"label {unknown[0]!r} is not among {labels}" if unknown else f"{len(labels)} label(s): needs two"
        raise DataError(f"validate.zero_shot: {config.zero_shot}: {what}")
    prefix = list(affixes_of(hf_encode(tokenizer)).prefix)  # the BOS a model trained with one always saw first
    prompt = config.zero_shot_prompt
    encoded = [
        {"context": prefix + tokenizer(prompt.format(text=text), add_special_tokens=False)["input_ids"],
         "answer": labels.index(label)}
        for text, label in items
    ]  # fmt: skip
    halves = {name: encoded[offset::2] for offset, name in enumerate(ZERO_SHOT_SPLITS)}
    if min(len(h) for h in halves.values()) < 2:
        raise DataError(f"validate.zero_shot: {config.zero_shot} has {len(items)} items: give at least 4")
    targets = [tokenizer(" " + label, add_special_tokens=False)["input_ids"] for label in labels]
    return {"labels": labels, "prompt": config.zero_shot_prompt, "targets": targets, **halves}


def validate_corpus(config: ValidateConfig, layout: Layout) -> CorpusReport:
    """Reads, splits by document, checks (Great Expectations) and blocks a causal LM's corpus.

    Writes `artifacts/validate/corpus.npz` (train/val/test token blocks, the model's own tokenizer;
    with `general_text`, up to `general_blocks` blocks of each of its halves as `general_val` and
    `general`), with `zero_shot` the check's items (`zero_shot.json`),
    the prompt-drift reference (the most frequent training tokens and their shares) and a summary.

    Raises:
        DataError: The file cannot be read, or too few documents to split.
        DataValidationError: An expectation failed (nothing is written).
    """
    documents = read_documents(config.path, config.text_column, config.encoding)
    dropped = 0
    if config.drop_duplicates:
        documents, dropped = _drop_repeats(documents)
    splits = split_documents(documents, config.val_fraction, config.test_fraction, config.seed)
    tokenizer = load_causal_tokenizer(config.tokenizer)
    blocks, tokens = {}, {}
    for name, docs in splits.items():
        blocks[name], tokens[name] = to_blocks(docs, tokenizer, config.block_length)
    suite = run_corpus_suite(
        splits=splits,
        blocks=blocks,
        text_length=(config.min_text_chars, config.max_text_chars),
        max_duplicate_fraction=config.max_duplicate_fraction,
        max_leakage_fraction=config.max_leakage_fraction,
        unknown_id=getattr(tokenizer, "unk_token_id", None),
        max_unknown_token_rate=config.max_unknown_token_rate,
    )
    raise_if_failed(suite)
    if config.general_text:  # text beyond the user's domain: gated on one half, reported on the other
        blocks.update(_general_halves(config, tokenizer))
        tokens.update({name: int(blocks[name].size) for name in GENERAL_SPLITS})
    zero_shot = _zero_shot_items(config, tokenizer) if config.zero_shot else None
    if zero_shot is not None:
        tokens.update({f"{name} items": len(zero_shot[name]) for name in ZERO_SHOT_SPLITS})
    out = layout.stage_dir("validate")
    with staged_output_paths(out, layout.metrics("validate")) as staged:
        folder = staged.path(out)
        folder.mkdir(parents=True)
        np.savez_compressed(folder / CORPUS_FILE, **{k: v.astype(np.int32) for k, v in blocks.items()})
        dump_json(prompt_reference([b.tolist() for b in blocks["train"]]), folder / REFERENCE_FILE)
        if zero_shot is not None:
            dump_json(zero_shot, folder / ZERO_SHOT_FILE)
        report = CorpusReport(
            dataset=config.dataset,
            documents={k: len(v) for k, v in splits.items()},
            tokens=tokens,
            blocks={k: len(v) for k, v in blocks.items()},
            block_length=config.block_length,
            duplicates_dropped=dropped,
            expectations_evaluated=len(suite.outcomes),
            expectations_failed=len(suite.failed),
            data_dir=out,
        )
        dump_json(report.metrics(), staged.path(layout.metrics("validate")))
    return report
