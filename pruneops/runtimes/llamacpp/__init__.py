"""llama.cpp: a decoder LLM as GGUF (fp32, F16, Q8_0, Q4_K_M), scored, timed and served by llama-cpp-python.

The artefact is a folder holding `model.gguf` (weights, tokenizer and chat template in one file),
what a llama.cpp user loads with `llama-cli -m` or `Llama(model_path=...)`. llama-cpp-python is
built from its PyPI sdist by `make llama-cpp` (no wheel for this CPU on PyPI); where it is not
built, GGUF files are still written (fp32, F16, Q8_0) and checked through transformers, and
opening one says what is missing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from pruneops.core.errors import PruneOpsError
from pruneops.core.integrity import file_sha256
from pruneops.runtimes.base import Runtime
from pruneops.runtimes.llamacpp.model import MODEL_FILE, PRECISIONS, LlamaCppModel
from pruneops.timing.generation import DecodeWorkload, GenerationTiming, time_interleaved


class LlamaCppRuntime(Runtime):
    """llama.cpp on the CPU, through llama-cpp-python."""

    name: ClassVar[str] = "llamacpp"
    task: ClassVar[str] = "causal_lm"
    precisions: ClassVar[tuple[str, ...]] = PRECISIONS
    export_kind: ClassVar[str] = "a llama.cpp GGUF folder (model.gguf)"
    max_batch: ClassVar[int | None] = 1  # llama-cpp-python's Llama runs one sequence

    def export(
        self, model: Any, out: Path, precisions: Sequence[str], *, tokenizer: object, threads: int = 1
    ) -> dict[str, Path]:
        """One folder per precision (`out/<precision>/model.gguf`); a cut output vocabulary is padded back to full."""
        from pruneops.runtimes.llamacpp.export import export_gguf  # torch and transformers: not for serving

        self.check_precisions(precisions)
        return export_gguf(model, tokenizer, Path(out), list(precisions), threads)

    def open(self, artefact: Path, threads: int = 1) -> LlamaCppModel:
        return LlamaCppModel(artefact, threads)

    def cannot_serve(self, model: Any, *, tokenizer: object) -> str | None:
        """Converts a two-layer random copy of the model's family and checks its tokens and losses in llama.cpp."""
        from pruneops.runtimes.llamacpp.export import family_problem  # torch and transformers: not for serving

        return family_problem(model, tokenizer)

    def time(self, artefacts: Mapping[str, Path], workload: DecodeWorkload) -> dict[str, GenerationTiming]:
        if workload.prompt.shape[0] != 1:
            raise PruneOpsError("llama.cpp runtime: timed at batch 1 only (llama-cpp-python runs one sequence)")
        opened = {name: self.timer(path) for name, path in artefacts.items()}
        return time_interleaved(opened, workload)

    def contract(self, artefact: Path, metadata: Mapping[str, Any]) -> dict[str, Any]:
        """Its vocabulary and its tokenizer's digest (`tokenizer.json` beside the file, as a genai folder has).

        The same tokenizer gives the same contract in either runtime, so a promotion may move between them.
        """
        tokenizer = Path(artefact) / "tokenizer.json"
        return {
            "num_classes": LlamaCppModel(artefact).vocab_size,
            "tokenizer_sha256": file_sha256(tokenizer if tokenizer.is_file() else Path(artefact) / MODEL_FILE),
        }

    def files(self, artefact: Path) -> list[Path]:
        return sorted(p for p in Path(artefact).rglob("*") if p.is_file())

    def recognises(self, artefact: Path) -> bool:
        return (Path(artefact) / MODEL_FILE).is_file()

    def versions(self) -> dict[str, str]:
        """llama-cpp-python's version, or that it is not built (then nothing here was timed by it)."""
        try:
            import llama_cpp
        except ImportError:
            return {"llama_cpp_python": "not built (make llama-cpp)"}
        return {"llama_cpp_python": llama_cpp.__version__}


RUNTIME = LlamaCppRuntime()
