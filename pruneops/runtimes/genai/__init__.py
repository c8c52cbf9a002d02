"""onnxruntime-genai: a decoder LLM exported by its model builder (fp32, INT8 or INT4 weights), timed and served.

The folder the builder writes (`model.onnx` and its data, `genai_config.json`, the tokenizer) is
the artefact; it is scored by its own logits in ONNX Runtime, generated from by onnxruntime-genai's
loop. Requires the `llm` extra.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from pruneops.core.errors import ConfigError
from pruneops.core.integrity import file_sha256
from pruneops.runtimes.base import Runtime
from pruneops.runtimes.genai.generation import (
    PRECISIONS,
    GenaiTimed,
    exported_block_losses,
    generate_once,
    greedy_tokens,
    time_generation,
    window_of,
)
from pruneops.timing.generation import DecodeWorkload, GenerationTiming

CONFIG_FILE = "genai_config.json"
log = logging.getLogger(__name__)


class Generation:
    """One sequence being generated: the prompt is read on the first `step`, each `step` yields one token.

    `max_length` (prompt included) ends it even where the generator's cache is longer (a sliding
    window wants a cache at least a window long).
    """

    def __init__(self, generator: Any, prompt: np.ndarray, max_length: int):
        self._generator, self._prompt = generator, prompt
        self._length, self._max_length = len(prompt), max_length

    def step(self) -> int:
        """Generates the next token (the first one reads the prompt: prefill) and returns it."""
        if self._prompt is not None:
            self._generator.append_tokens(self._prompt)
            self._prompt = None
        self._generator.generate_next_token()
        self._length += 1
        return int(self._generator.get_next_tokens()[0])

    @property
    def done(self) -> bool:
        """Whether the sequence ended (end of sequence, or its length)."""
        return self._length >= self._max_length or bool(self._generator.is_done())


class GenaiModel:
    """An onnxruntime-genai folder opened for scoring (its logits in ONNX Runtime) and generation."""

    def __init__(self, folder: Path, threads: int = 1):
        self.folder, self.threads = Path(folder), threads
        if not (self.folder / CONFIG_FILE).is_file():
            raise ConfigError(f"{self.folder} is not an onnxruntime-genai model folder (no {CONFIG_FILE})")
        config = json.loads((self.folder / CONFIG_FILE).read_text())["model"]
        self.vocab_size = int(config["vocab_size"])
        self.context_length = int(config.get("context_length", 2048))  # prompt and generated tokens together
        self.window = window_of(config)  # the cache holds at least this many tokens
        self.max_concurrent = 8  # generations a server may step in turn (each its own generator and cache)
        self._model: Any = None
        self._scorer: tuple[Any, dict] | None = None

    def load(self) -> GenaiModel:
        """Loads the model for generation now (a folder that does not load fails here, not on a request)."""
        import onnxruntime_genai as og

        if self._model is None:
            self._model = og.Model(str(self.folder))
        return self

    def serving(self) -> Any:
        """What a server decodes with: a `BatchDecoder` (sequences batched) where the family allows, else itself."""
        from pruneops.runtimes.genai.batch import BatchDecoder

        why = BatchDecoder.supports(self.folder)
        if why is not None:
            log.warning("%s: sequences are decoded one at a time (no batching with %s)", self.folder.name, why)
            return self.load()
        config = json.loads((self.folder / CONFIG_FILE).read_text())["model"]["decoder"]
        threads = int(config.get("session_options", {}).get("intra_op_num_threads", self.threads))
        return BatchDecoder(self.folder, threads)

    def losses(self, blocks: np.ndarray) -> np.ndarray:
        """Mean next-token NLL of each block (prefill with an empty cache)."""
        return exported_block_losses(self.folder, blocks, threads=self.threads)

    def token_losses(self, ids: np.ndarray) -> np.ndarray:
        """Next-token NLL at every position of one sequence (position i: token i + 1)."""
        from pruneops.runtimes.genai.scoring import prefill_losses

        return prefill_losses(*self._opened_scorer(), np.asarray(ids))

    def logits(self, ids: np.ndarray) -> np.ndarray:
        """The logits at every position of one sequence (prefill from an empty cache), (length, vocab)."""
        from pruneops.runtimes.genai.scoring import prefill_logits

        return prefill_logits(*self._opened_scorer(), np.asarray(ids).reshape(-1))

    def _opened_scorer(self) -> tuple[Any, dict]:
        from pruneops.runtimes.genai.scoring import open_scorer

        if self._scorer is None:
            self._scorer = open_scorer(self.folder, self.threads)
        return self._scorer

    def greedy(self, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
        """Greedy continuation of a (batch, length) prompt: (batch, new_tokens) token ids."""
        return greedy_tokens(self.folder, prompt, new_tokens)

    def generate_timed(self, prompt: np.ndarray, new_tokens: int) -> tuple[float, list[float], np.ndarray]:
        """One timed greedy generation of a (batch, length) prompt (`time_interleaved`'s protocol)."""
        return generate_once(self.load()._model, np.ascontiguousarray(prompt, dtype=np.int32), new_tokens, self.window)

    def start(self, prompt: Sequence[int], max_length: int, sampling: Mapping[str, Any] | None = None) -> Generation:
        """A generation of one sequence up to `max_length` tokens (prompt included).

        `sampling`: temperature, top_k, top_p and seed (None: greedy).
        """
        import onnxruntime_genai as og

        self.load()
        params = og.GeneratorParams(self._model)
        options: dict[str, Any] = {"max_length": max(max_length, self.window), "do_sample": sampling is not None}
        if sampling is not None:
            options.update({k: v for k, v in sampling.items() if k != "seed"})
            if sampling.get("seed") is not None:
                options["random_seed"] = sampling["seed"]
        params.set_search_options(**options)
        return Generation(og.Generator(self._model, params), np.asarray(prompt, dtype=np.int32), max_length)


class GenaiRuntime(Runtime):
    """onnxruntime-genai on the CPU."""

    name: ClassVar[str] = "genai"
    task: ClassVar[str] = "causal_lm"
    precisions: ClassVar[tuple[str, ...]] = PRECISIONS
    export_kind: ClassVar[str] = "an onnxruntime-genai model folder (genai_config.json)"

    def export(
        self, model: Any, out: Path, precisions: Sequence[str], *, tokenizer: object, threads: int = 1
    ) -> dict[str, Path]:
        """One builder folder per precision (`out/<precision>`); a cut output vocabulary is gathered back to full."""
        from pruneops.runtimes.genai.export import export_model  # torch and transformers: not for serving

        self.check_precisions(precisions)
        return export_model(model, tokenizer, Path(out), list(precisions), threads)

    def open(self, artefact: Path, threads: int = 1) -> GenaiModel:
        return GenaiModel(artefact, threads)

    def cannot_serve(self, model: Any, *, tokenizer: object) -> str | None:
        """Builds a two-layer random copy of the model's family and checks its tokens and losses against torch's."""
        from pruneops.runtimes.genai.export import family_problem  # torch and transformers: not for serving

        return family_problem(model, tokenizer)

    def timer(self, artefact: Path) -> GenaiTimed:
        return GenaiTimed(artefact)

    def time(self, artefacts: Mapping[str, Path], workload: DecodeWorkload) -> dict[str, GenerationTiming]:
        return time_generation(dict(artefacts), workload.prompt, workload.new_tokens, workload.rounds, workload.warmup)

    def contract(self, artefact: Path, metadata: Mapping[str, Any]) -> dict[str, Any]:
        """Its vocabulary and its tokenizer's digest: a candidate that tokenises otherwise serves other requests."""
        tokenizer = Path(artefact) / "tokenizer.json"
        return {
            "num_classes": GenaiModel(artefact).vocab_size,
            "tokenizer_sha256": file_sha256(tokenizer) if tokenizer.is_file() else None,
        }

    def files(self, artefact: Path) -> list[Path]:
        return sorted(p for p in Path(artefact).rglob("*") if p.is_file())

    def recognises(self, artefact: Path) -> bool:
        return (Path(artefact) / CONFIG_FILE).is_file()

    def versions(self) -> dict[str, str]:
        import onnxruntime_genai

        from pruneops.runtimes.onnxruntime import RUNTIME as ONNXRUNTIME

        return {**ONNXRUNTIME.versions(), "onnxruntime_genai": onnxruntime_genai.__version__}


RUNTIME = GenaiRuntime()
