"""`validate.dataset: text`: reading tables of sentences, the text suite, tokenising to named arrays.

A tiny word-level tokenizer is built here (no downloads); `test_real_reviews_*` uses the Rotten
Tomatoes reviews and MiniLM's tokenizer when `make text-assets` has fetched them.
"""

import bz2
import gzip
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pruneops.config import ValidateConfig
from pruneops.core.errors import ConfigError, DataError, DataValidationError
from pruneops.core.io import Layout, read_json
from pruneops.data import load_prepared
from pruneops.data.text import choose_max_length, normalise, read_text_table
from pruneops.task.classification.validate import validate_dataset
from tests.text_helpers import build_tokenizer, make_reviews

pytest.importorskip("tokenizers", reason="tokenizers (the `hf` extra) is not installed")

ASSETS = Path(__file__).resolve().parents[2] / "assets"  # where make text-assets puts them


def _config(tmp_path, path, **kw) -> ValidateConfig:
    tokenizer = build_tokenizer(tmp_path / "tokenizer.json")
    return ValidateConfig(dataset="text", path=str(path), label_column="category", tokenizer=str(tokenizer), **kw)


@pytest.mark.parametrize("name", ["r.csv", "r.csv.gz", "r.csv.bz2", "r.tsv", "r.jsonl", "r.jsonl.gz", "r.parquet"])
def test_every_table_format_reads_the_same_texts_and_labels(tmp_path, name):
    frame = make_reviews(40)
    path = tmp_path / name
    if name.startswith("r.parquet"):
        frame.to_parquet(path)
    elif ".jsonl" in name:
        text = frame.to_json(orient="records", lines=True)
        path.write_bytes(gzip.compress(text.encode()) if name.endswith(".gz") else text.encode())
    else:
        text = frame.to_csv(index=False, sep="\t" if ".tsv" in name else ",")
        data = text.encode()
        path.write_bytes(
            gzip.compress(data) if name.endswith(".gz") else bz2.compress(data) if name.endswith(".bz2") else data
        )
    table = read_text_table(path, "text", "category")
    assert table.texts == frame["text"].tolist()
    assert table.label_names == ["fresh", "rotten"]
    assert table.labels.tolist() == [0 if c == "fresh" else 1 for c in frame["category"]]


def test_integer_labels_are_kept_and_excluded_labels_dropped(tmp_path):
    frame = pd.DataFrame({"text": ["a", "b", "c", "d", "e"], "label": ["3", "1", "plot", "3", "1"]})
    frame.to_csv(tmp_path / "t.csv", index=False)
    table = read_text_table(tmp_path / "t.csv", "text", "label", exclude_labels=["plot"])
    assert table.labels.tolist() == [3, 1, 3, 1] and table.label_names is None
    assert table.dropped == {"empty label": 0, "excluded label": 1}


def test_encoding_errors_name_the_setting_and_the_setting_works(tmp_path):
    path = tmp_path / "latin.csv"
    path.write_bytes("text,label\ncafé crème,a\nnaïve,b\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"not utf-8 text .*set validate.encoding"):
        read_text_table(path, "text", "label")
    table = read_text_table(path, "text", "label", encoding="latin-1")
    assert table.texts == ["café crème", "naïve"]
    with pytest.raises(ConfigError, match="unknown encoding"):
        read_text_table(path, "text", "label", encoding="no-such-codec")


def test_missing_column_and_unknown_format_are_named(tmp_path):
    make_reviews(10).to_csv(tmp_path / "r.csv", index=False)
    with pytest.raises(DataError, match=r"column 'review' not found; columns: \['text', 'category'\]"):
        read_text_table(tmp_path / "r.csv", "review", "category")
    (tmp_path / "r.xlsx").write_bytes(b"x")
    with pytest.raises(DataError, match="cannot tell the format from .xlsx"):
        read_text_table(tmp_path / "r.xlsx", "text", "category")


def test_text_without_a_tokenizer_is_a_config_error():
    with pytest.raises(ValueError, match="tokenizer: required for dataset 'text'"):
        ValidateConfig(dataset="text", path="r.csv")


def test_validate_writes_named_int64_splits_labels_and_text_statistics(tmp_path):
    frame = make_reviews(300)
    frame = pd.concat([frame, frame.iloc[:7].assign(text=lambda f: f["text"].str.upper() + "  ")])  # 7 repeats
    frame.to_csv(tmp_path / "r.csv", index=False)
    report = validate_dataset(_config(tmp_path, tmp_path / "r.csv"), Layout(tmp_path / "run"))
    assert report.duplicates_dropped == 7  # case and whitespace do not make a new sentence
    meta, train, val, test = load_prepared(report.data_dir)
    assert meta.class_names == ["fresh", "rotten"] and meta.num_classes == 2
    assert [i["name"] for i in meta.inputs] == ["input_ids", "attention_mask"]
    assert len(train) + len(val) + len(test) == 300
    lengths = np.array([len(t.split()) + 2 for t in frame["text"][:300]])  # words + [CLS] + [SEP]
    max_length = meta.text["max_length"]
    assert max_length % 8 == 0 and max_length >= 8
    for split in (train, val, test):
        assert split.named and split.x["input_ids"].dtype == np.int64
        assert split.x["input_ids"].shape == (len(split), max_length) == split.x["attention_mask"].shape
        real = split.x["attention_mask"].sum(axis=1)
        assert real.min() >= 3 and real.max() <= max_length
        assert (split.x["input_ids"][:, 0] == 2).all()  # [CLS] first: the tokenizer's post-processor ran
    # `zz<i>` is not in the vocabulary: exactly one unknown token per text.
    stats = read_json(report.data_dir / "reference_stats.json")
    n_real = int(train.x["attention_mask"].sum())
    assert stats["unknown_token_rate"] == pytest.approx(len(train) / n_real, rel=1e-3)
    assert sum(stats["token_length_histogram"]) == pytest.approx(1.0, abs=1e-4)
    assert stats["class_frequencies"] == pytest.approx([float((train.y == c).mean()) for c in (0, 1)], abs=1e-6)
    assert (report.data_dir / "tokenizer.json").is_file()
    assert abs(max_length - np.quantile(lengths, 0.95)) <= 8


def test_text_suite_fails_on_empty_text_and_on_duplicates_kept(tmp_path):
    frame = make_reviews(100)
    frame.loc[5, "text"] = "   "
    frame.to_csv(tmp_path / "empty.csv", index=False)
    with pytest.raises(DataValidationError, match=r"n_chars"):
        validate_dataset(_config(tmp_path, tmp_path / "empty.csv"), Layout(tmp_path / "a"))
    frame = make_reviews(100)
    frame = pd.concat([frame, frame.iloc[:30]])
    frame.to_csv(tmp_path / "dupes.csv", index=False)
    with pytest.raises(DataValidationError, match=r"repeats_earlier|in_train"):
        validate_dataset(_config(tmp_path, tmp_path / "dupes.csv", drop_duplicates=False), Layout(tmp_path / "b"))
    assert not (tmp_path / "a" / "artifacts").exists() and not (tmp_path / "b" / "artifacts").exists()


def test_too_few_samples_per_class_fails(tmp_path):
    frame = make_reviews(60)
    frame.loc[frame.index[:3], "category"] = "meh"
    frame.to_csv(tmp_path / "r.csv", index=False)
    with pytest.raises(DataValidationError, match=r"count"):
        validate_dataset(_config(tmp_path, tmp_path / "r.csv", min_samples_per_class=5), Layout(tmp_path / "a"))


def test_max_length_holds_the_quantile_rounded_up():
    assert choose_max_length(np.array([5] * 95 + [100] * 5)) == 8
    assert choose_max_length(np.array([20] * 100)) == 24
    assert choose_max_length(np.array([5000] * 10)) == 512
    assert normalise("  Great\tFILM \n") == "great film"


@pytest.mark.slow
def test_real_reviews_validate_with_the_minilm_tokenizer(tmp_path):
    reviews, minilm = ASSETS / "rotten_tomatoes_corpus_full.csv.bz2", ASSETS / "all-minilm-l6-v2"
    if not reviews.is_file() or not (minilm / "tokenizer.json").is_file():
        pytest.skip("Rotten Tomatoes reviews / MiniLM not fetched: run `make text-assets`")
    config = ValidateConfig(
        dataset="text",
        path=str(reviews),
        label_column="category",
        exclude_labels=["plot"],
        tokenizer=str(minilm),
        test_fraction=0.2,
    )
    report = validate_dataset(config, Layout(tmp_path))
    assert report.n_test >= 2000
    meta = read_json(report.data_dir / "meta.json")
    assert meta["class_names"] == ["fresh", "rotten"] and meta["text"]["dropped_rows"]["excluded label"] > 1000
    assert meta["text"]["truncated_fraction"] <= 0.05 + 1e-9


def test_a_text_dataset_without_the_tokenizers_library_says_which_extra_to_install(tmp_path, monkeypatch):
    import sys

    from pruneops.core.errors import ConfigError
    from pruneops.data.text import load_tokenizer

    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers now raises ImportError
    with pytest.raises(ConfigError, match=r"validate.tokenizer: text datasets need the tokenizers library .*\[hf\]"):
        load_tokenizer(tmp_path)
