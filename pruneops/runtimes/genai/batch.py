"""Decoding several sequences of different lengths in one batch, on an onnxruntime-genai folder's own model.

onnxruntime-genai 0.18's generator batches only prompts padded on the left, and its attention
(GroupQueryAttention) then reads the padding as tokens: a short prompt's continuation changes
with its neighbours. Its continuous-batching `Engine` runs on the CPU but steps no faster than one
sequence at a time. This module runs the folder's `model.onnx` in ONNX Runtime and keeps the KV
cache itself, each row padded on the right: GroupQueryAttention takes each row's length from its
attention mask (`seqlens_k`), so every row attends to its own tokens only and its greedy
continuation is the one it has alone. A new sequence is prefilled (one per step, see
`prefills_per_step`), then joins the batch; one decode step advances every row by a token. Rows
join and leave between steps.

Sampling (temperature, top-k, top-p, seed) is drawn here, per row, from the row's logits.
Families with sliding-window attention or explicit position ids are not batched here
(`BatchDecoder.supports` says why); the server then steps their sequences one at a time.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_BATCH = 8


class BatchGeneration:
    """One sequence of a `BatchDecoder`: its prompt, bounds, sampling, tokens so far and its own KV rows."""

    def __init__(self, decoder: BatchDecoder, prompt: Sequence[int], max_length: int, sampling: Mapping | None):
        self.decoder, self.prompt, self.max_length = decoder, [int(t) for t in prompt], max_length
        self.sampling = dict(sampling or {})
        self.rng = np.random.default_rng(self.sampling.get("seed"))
        self.cached = 0  # tokens in its KV cache
        self.total = len(self.prompt)  # prompt and generated tokens
        self.last: int | None = None  # the token to feed next (None: not prefilled yet)
        self.done = False
        self.kv: list[np.ndarray] | None = None  # its cache while outside a batch: (1, heads, length, dim) each

    def choose(self, logits: np.ndarray) -> int:
        """The next token from this row's logits (greedy without sampling), and whether the sequence ends."""
        token = _sample(logits, self.sampling, self.rng)
        self.last, self.total = token, self.total + 1
        self.done = token in self.decoder.eos_ids or self.total >= self.max_length
        return token

    def step(self) -> int:
        """One token of this sequence alone (what a scheduler without batching calls)."""
        return int(self.decoder.step_batch([self])[0])


def _sample(logits: np.ndarray, sampling: Mapping, rng: np.random.Generator) -> int:
    temperature = sampling.get("temperature")
    if not sampling or not temperature:
        return int(np.argmax(logits))
    scaled = logits.astype(np.float64) / temperature
    top_k = int(sampling.get("top_k") or 0)
    order = np.argsort(-scaled)[:top_k] if 0 < top_k < len(scaled) else np.argsort(-scaled)
    probs = np.exp(scaled[order] - scaled[order[0]])
    probs /= probs.sum()
    top_p = sampling.get("top_p")
    if top_p is not None and top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), float(top_p)) + 1)
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(order), p=probs)])


class BatchDecoder:
    """A genai folder's decoder stepping many sequences together (see the module docstring).

    Holds the batch: its sequences in row order and their KV cache, (rows, heads, width, dim) per
    layer and kind, each row's valid tokens first. `step_batch` prefills a new sequence,
    rebuilds the batch when its members changed, and decodes one token for every other row.
    """

    def __init__(self, folder: Path, threads: int = 1, max_concurrent: int = DEFAULT_BATCH):
        from pruneops.runtimes.genai.scoring import open_scorer

        self.folder = Path(folder)
        config = json.loads((self.folder / "genai_config.json").read_text())["model"]
        self.session, self.config = open_scorer(self.folder, threads)
        self.vocab_size, self.context_length = int(config["vocab_size"]), int(config.get("context_length", 2048))
        eos = config.get("eos_token_id", [])
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.max_concurrent = max_concurrent
        # Prompts read per step. One: on a 2-core EPYC, 8 SmolLM2 prompts (20-60 tokens) prefilled
        # together took 985-1046 ms, one after another 785-812 ms (padding costs more than batching
        # saves), and the rows already running wait for one prefill, not eight.
        self.prefills_per_step = 1
        names = self.config["inputs"]
        self.past = [names[kind] % layer for layer in range(self.config["num_hidden_layers"])
                     for kind in ("past_key_names", "past_value_names")]  # fmt: skip
        outputs = self.config["outputs"]
        self.present = [outputs[kind] % layer for layer in range(self.config["num_hidden_layers"])
                        for kind in ("present_key_names", "present_value_names")]  # fmt: skip
        spec = {i.name: i for i in self.session.get_inputs()}
        self.kv_dtype = np.float16 if "float16" in spec[self.past[0]].type else np.float32
        self.ids_dtype = np.int64 if "int64" in spec["input_ids"].type else np.int32
        self.heads, self.dim = self.config["num_key_value_heads"], self.config["head_size"]
        self._rows: list[BatchGeneration] = []
        self._kv: list[np.ndarray] = []

    def load(self) -> BatchDecoder:
        """Loaded already (the session opens in the constructor)."""
        return self

    def token_losses(self, ids: np.ndarray) -> np.ndarray:
        """Next-token NLL at every position of one sequence (prefill with an empty cache), as `GenaiModel`'s."""
        from pruneops.runtimes.genai.scoring import prefill_losses

        return prefill_losses(self.session, self.config, np.asarray(ids))

    @staticmethod
    def supports(folder: Path) -> str | None:
        """Why a folder's model cannot be batched here (None: it can)."""
        decoder = json.loads((Path(folder) / "genai_config.json").read_text())["model"]["decoder"]
        if decoder.get("sliding_window"):
            return "sliding-window attention"
        if "position_ids" in decoder.get("inputs", {}):
            return "explicit position ids"
        if decoder.get("filename", "model.onnx") != "model.onnx" or not (Path(folder) / decoder["filename"]).is_file():
            return "no single decoder model file"
        return None

    def start(self, prompt: Sequence[int], max_length: int, sampling: Mapping[str, Any] | None = None):
        """A sequence up to `max_length` tokens (prompt included); prefilled on its first `step_batch`."""
        return BatchGeneration(self, prompt, max_length, sampling)

    def _run(self, ids: np.ndarray, mask: np.ndarray, kv: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
        feed = {"input_ids": ids.astype(self.ids_dtype), "attention_mask": mask.astype(np.int64)}
        feed.update(zip(self.past, kv, strict=True))
        out = self.session.run(["logits", *self.present], feed)
        return out[0], out[1:]

    def _prefill(self, fresh: list[BatchGeneration]) -> dict[int, int]:
        """Reads the prompts of new sequences in one batch, each padded on the right; their first tokens.

        Causal attention keeps a row's tokens from seeing the padding after them, and each row's
        cache is cut to its own prompt.
        """
        width = max(len(g.prompt) for g in fresh)
        ids = np.zeros((len(fresh), width), np.int64)
        mask = np.zeros((len(fresh), width), np.int64)
        for b, generation in enumerate(fresh):
            ids[b, : len(generation.prompt)] = generation.prompt
            mask[b, : len(generation.prompt)] = 1
        empty = [np.zeros((len(fresh), self.heads, 0, self.dim), self.kv_dtype) for _ in self.past]
        logits, kv = self._run(ids, mask, empty)
        tokens = {}
        for b, generation in enumerate(fresh):
            n = len(generation.prompt)
            generation.kv, generation.cached = [layer[b : b + 1, :, :n] for layer in kv], n
            tokens[id(generation)] = generation.choose(logits[b, n - 1])
        return tokens

    def _rebuild(self, rows: list[BatchGeneration]) -> None:
        """The batch's cache for `rows` (each row's cache from the old batch or its own prefill)."""
        own = {}
        for generation in rows:
            if generation in self._rows:
                b = self._rows.index(generation)
                own[id(generation)] = [layer[b : b + 1, :, : generation.cached] for layer in self._kv]
            else:
                own[id(generation)] = generation.kv
        width = max(g.cached for g in rows)
        self._kv = []
        for k in range(len(self.past)):
            buffer = np.zeros((len(rows), self.heads, width, self.dim), self.kv_dtype)
            for b, generation in enumerate(rows):
                buffer[b, :, : generation.cached] = own[id(generation)][k][0, :, : generation.cached]
            self._kv.append(buffer)
        for generation in rows:
            generation.kv = None
        self._rows = list(rows)

    def step_batch(self, generations: Sequence[BatchGeneration]) -> list[int | None]:
        """One token for each sequence: up to `prefills_per_step` new ones prefilled, the others decoded in one batch.

        A new sequence beyond `prefills_per_step` gets None (no token yet: it is prefilled in a later
        step), so the running rows keep decoding while a crowd of new prompts is read. Sequences
        that were in the batch and are not passed (ended, cancelled) leave it.
        """
        fresh = [g for g in generations if g.last is None][: self.prefills_per_step]
        tokens = self._prefill(fresh) if fresh else {}
        rows = [g for g in generations if g.last is not None and g not in fresh]
        if rows:
            if rows != self._rows:
                self._rebuild(rows)
            width = self._kv[0].shape[2] + 1
            mask = np.zeros((len(rows), width), np.int64)
            for b, generation in enumerate(rows):
                mask[b, : generation.cached + 1] = 1  # its cache and the token fed now
            ids = np.asarray([[g.last] for g in rows])
            logits, self._kv = self._run(ids, mask, self._kv)
            for b, generation in enumerate(rows):
                generation.cached += 1
                tokens[id(generation)] = generation.choose(logits[b, -1])
        elif self._rows:
            self._rows, self._kv = [], []
        return [tokens.get(id(g)) for g in generations]
