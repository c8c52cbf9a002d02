"""Tiny random causal LMs of every registered family and a word-level tokenizer, built in the test."""

from __future__ import annotations

from pathlib import Path

import torch

_TEXT = """the a of to and in is was for on that with as by at from it this be are people we our nation
work jobs family country america president vote future thank you good bad film movie great awful"""
WORDS = _TEXT.split()
SPECIALS = ["<unk>", "<eos>", "<pad>"]
VOCAB = len(SPECIALS) + len(WORDS)


BOS_ID = VOCAB  # `tiny_tokenizer(bos=True)` only: one id past the others (its models take VOCAB + 1)


def tiny_tokenizer(bos: bool = False):
    """A word-level fast tokenizer with <eos> and <unk> (what a corpus and a zero-shot check need).

    With `bos`, it also prepends <bos> (id `BOS_ID`) to every text, as Llama's and Gemma's do.
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIALS, *WORDS, *(["<bos>"] if bos else [])])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS_ID)]
        )
    specials = {"unk_token": "<unk>", "eos_token": "<eos>", "pad_token": "<pad>"}
    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials, **({"bos_token": "<bos>"} if bos else {}))


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


def tiny_decoder(family: str, seed: int = 0, std: float = 0.2, **sizes: int) -> torch.nn.Module:
    """A 4-layer random causal LM of `family` in eval mode, biases made non-zero so reconstruction shows.

    `sizes` override the family's config (e.g. `hidden_size`); weights are drawn with `std`.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _config(family)
    for key, value in sizes.items():
        setattr(config, key, value)
    return _randomised(AutoModelForCausalLM.from_config(config, dtype=torch.float32), std)


def _randomised(model: torch.nn.Module, std: float) -> torch.nn.Module:
    """Every weight but the norms drawn with `std` (biases non-zero, so reconstruction shows), in eval mode."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name and "ln" not in name:
                param.normal_(0.0, std)
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


def save_small_llama(folder: Path, seed: int = 0) -> Path:
    """A 4-layer Llama big enough that cutting it is timed above noise (hidden 256, MLP 1024, 2 KV groups)."""
    sizes = {"hidden_size": 256, "intermediate_size": 1024, "head_dim": 64, "max_position_embeddings": 256}
    tiny_decoder("llama", seed, std=0.05, **sizes).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def decoder_params(model: Path, corpus: Path, **overrides: dict) -> dict:
    """A causal-LM params file for a tiny model and a made-up corpus (seconds per stage)."""
    params = {
        "validate": {"dataset": "corpus", "path": str(corpus), "tokenizer": str(model), "block_length": 32,
                     "val_fraction": 0.15, "test_fraction": 0.15},
        "train": {"task": "causal_lm", "model": "hf", "pretrained": str(model), "epochs": 0},
        "sensitivity": {},
        "latency": {},
        "prune": {"target": {"kind": "latency_ratio", "value": 0.8},
                  "gate": {"min_speedup": None, "max_perplexity_increase": None,
                           "max_general_perplexity_increase": None},
                  "decoder": {"calibration_blocks": 4, "search_blocks": 2, "depth_step": 1}},
        "finetune": {"max_tokens": 256, "batch_size": 2, "lr": 1e-3},
        "quantize": {"decoder_precisions": ["int8"]},
        "export": {"greedy_tokens": 16, "runtime": "genai"},  # auto: tests/task/causal_lm/test_runtimes.py
        "benchmark": {"batch_sizes": [1, 2], "prompt_length": 16, "new_tokens": 8, "rounds": 2},
    }  # fmt: skip
    for section, values in overrides.items():
        params[section] = {**params[section], **values}
    return params


# Every decoder family of transformers 5 that decoder pruning is tested on, by `model_type`: the
# onnxruntime-genai builder here (0.18) exports the first group and gives the torch model's greedy
# tokens; the second is cut and reloaded in torch only (the builder refuses them, or for OLMo gives
# other tokens than transformers: see docs/reference/decoder-families.md).
SERVED_FAMILIES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "granite", "smollm3", "ernie4_5",
    "hunyuan_v1_dense", "phi", "nemotron", "gemma3_text",
)  # fmt: skip
TORCH_ONLY_FAMILIES = (
    "phi3", "olmo", "olmo2", "cohere", "starcoder2", "stablelm", "glm", "exaone4",
    "gpt2", "gpt_neox", "gptj", "opt", "bloom",
)  # fmt: skip


def family_decoder(
    model_type: str,
    layers: int = 3,
    seed: int = 0,
    vocab_size: int = VOCAB,
    hidden_size: int = 128,
    intermediate_size: int = 96,
) -> torch.nn.Module:
    """A tiny random causal LM of any family transformers builds (hidden 128, 4 query heads in 2 KV groups).

    Head size 32: onnxruntime-genai's attention needs a multiple of 16 and a rotary half that is a
    multiple of 8 under partial rotary embeddings (Phi, Nemotron).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=2,
        bos_token_id=1,
        eos_token_id=1,
    )
    if "head_dim" in config.to_dict():  # Qwen3, Gemma: their own defaults, not hidden / heads
        config.head_dim = 32
    if getattr(config, "rotary_dim", None):  # GPT-J: 64 by default, more than a head here
        config.rotary_dim = 16
    if getattr(config, "sliding_window", None):
        # onnxruntime-genai wants the window within the KV cache (prompt + new tokens); Mistral's
        # window edge differs between runtimes, so it gets none where its config allows it.
        config.sliding_window = None if model_type == "mistral" else 8
    torch.manual_seed(seed)
    return _randomised(AutoModelForCausalLM.from_config(config, dtype=torch.float32), 0.2)
