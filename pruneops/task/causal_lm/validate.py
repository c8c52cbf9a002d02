"""`validate` for a causal LM: the corpus read, split by document, checked and cut into token blocks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pruneops.config import ValidateConfig
from pruneops.core.io import Layout, dump_json, staged_output_paths
from pruneops.data.corpus import read_documents, split_documents, to_blocks
from pruneops.data.drift import prompt_reference
from pruneops.data.expectations import raise_if_failed, run_corpus_suite
from pruneops.data.text import text_digests
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


def validate_corpus(config: ValidateConfig, layout: Layout) -> CorpusReport:
    """Reads, splits by document, checks (Great Expectations) and blocks a causal LM's corpus.

    Writes `artifacts/validate/corpus.npz` (train/val/test token blocks, the model's own tokenizer;
    with `general_text`, up to `general_blocks` blocks of it as `general`),
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
    if config.general_text:  # text beyond the user's domain: the benchmark reports perplexity on it too
        general = read_documents(config.general_text, config.text_column, config.encoding)
        blocks["general"], tokens["general"] = to_blocks(general, tokenizer, config.block_length)
        blocks["general"] = blocks["general"][: config.general_blocks]
    out = layout.stage_dir("validate")
    with staged_output_paths(out, layout.metrics("validate")) as staged:
        folder = staged.path(out)
        folder.mkdir(parents=True)
        np.savez_compressed(folder / CORPUS_FILE, **{k: v.astype(np.int32) for k, v in blocks.items()})
        dump_json(prompt_reference([b.tolist() for b in blocks["train"]]), folder / REFERENCE_FILE)
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
