"""Tiny random causal LMs of every registered family and a word-level tokenizer, built in the test."""

from __future__ import annotations

from pathlib import Path

import torch

_TEXT = """the a of to and in is was for on that with as by at from it this be are people we our nation
work jobs family country america president vote future thank you good bad film movie great awful"""
WORDS = _TEXT.split()
SPECIALS = ["<unk>", "<eos>", "<pad>"]
VOCAB = len(SPECIALS) + len(WORDS)


def tiny_tokenizer():
    """A word-level fast tokenizer with <eos> and <unk> (what a corpus and a zero-shot check need)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIALS, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>")


def _config(family: str):
    import transformers as tf

    common = {"vocab_size": VOCAB, "max_position_embeddings": 128}
    if family == "llama":  # grouped-query attention: 4 query heads read 2 KV heads
        return tf.LlamaConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
            **common,
        )
    if family == "qwen2":  # biases on q/k/v
        return tf.Qwen2Config(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            **common,
        )
    if family == "mistral":
        return tf.MistralConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            sliding_window=None,
            **common,
        )
    if family == "gemma":
        return tf.GemmaConfig(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            **common,
        )
    if family == "gpt_neox":
        return tf.GPTNeoXConfig(
            hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, **common
        )
    if family == "gpt2":
        return tf.GPT2Config(n_embd=32, n_inner=48, n_layer=4, n_head=4, vocab_size=VOCAB, n_positions=128)
    raise ValueError(family)


FAMILIES = ("llama", "qwen2", "mistral", "gemma", "gpt_neox", "gpt2")
HEAD_FAMILIES = ("llama", "qwen2", "mistral", "gemma")  # separate q/k/v/o with an explicit head size


def tiny_decoder(family: str, seed: int = 0) -> torch.nn.Module:
    """A 4-layer random causal LM of `family` in eval mode, biases made non-zero so reconstruction shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name and "ln" not in name:
                param.normal_(0.0, 0.2)
    return model.eval()


def save_tiny(family: str, folder: Path, seed: int = 0) -> Path:
    """A tiny decoder and its tokenizer saved as a HuggingFace folder (what a user's folder holds)."""
    model = tiny_decoder(family, seed)
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def random_blocks(n: int, length: int = 24, seed: int = 0) -> torch.Tensor:
    """(n, length) token ids drawn from a skewed distribution (so activations are not uniform)."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, VOCAB + 1, dtype=torch.float64)
    return torch.multinomial(weights.expand(n * length, -1), 1, generator=g).reshape(n, length)


def speeches(n: int = 40, seed: int = 0) -> list[str]:
    """Distinct pseudo-speeches of 30-80 vocabulary words each."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(30, 80))).tolist()) for _ in range(n)]
