"""Tiny text fixtures built in the test (no downloads): a word-level tokenizer, labelled
sentences whose label a model can learn, and a small pretrained HuggingFace folder."""

from pathlib import Path

import numpy as np
import pandas as pd

WORDS = "good bad film movie plot great awful fine dull fun boring moving the a was is very not".split()  # noqa: SIM905
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]


def build_tokenizer(path: Path) -> Path:
    """A WordLevel `tokenizer.json` over `WORDS` with [CLS] ... [SEP] around each text."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate([*SPECIALS, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    tok.save(str(path))
    return path


def make_reviews(n: int = 300, seed: int = 0) -> pd.DataFrame:
    """Distinct sentences of 3-13 words; the first word (good/bad) gives the label (fresh/rotten)."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        words = rng.choice(WORDS, size=int(rng.integers(1, 12))).tolist()
        label = "fresh" if i % 2 else "rotten"
        rows.append({"text": " ".join([("good" if i % 2 else "bad"), *words, f"zz{i}"]), "category": label})
    return pd.DataFrame(rows)


def tiny_pretrained(folder: Path, num_labels: int | None = None, seed: int = 0) -> Path:
    """A 2-layer BERT saved with `save_pretrained` (a base model, or a classifier with `num_labels`)
    and the word-level tokenizer beside it: what a user's pretrained folder holds."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=len(SPECIALS) + len(WORDS),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64,
    )
    if num_labels is None:
        model = BertModel(config)
    else:
        config.num_labels = num_labels
        model = BertForSequenceClassification(config)
    model.save_pretrained(str(folder))
    build_tokenizer(folder / "tokenizer.json")
    return folder
