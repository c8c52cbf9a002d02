"""The runtime protocol: what every runtime a pruned model is exported to, timed in and served by provides.

A runtime is one folder under `pruneops/runtimes/` and one line in `RUNTIMES`
(`pruneops.runtimes`); only its folder imports its library. It exports a model in each of its
precisions, opens what it exported (logits and, for a decoder, generation), times a set of its
models interleaved round by round (machine drift then falls on every model alike), says what
requests an export serves (its contract, compared at promotion) and which files it is (what its
digests cover).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar


class Runtime(ABC):
    """One runtime. Subclasses name it, the task whose models it runs, and its precisions."""

    name: ClassVar[str]
    task: ClassVar[str]  # `train.task` of the models it runs
    precisions: ClassVar[tuple[str, ...]]  # fp32 first: the form every other one is compared with
    max_batch: ClassVar[int | None] = None  # the most sequences it times at once (None: no bound)
    export_kind: ClassVar[str] = "one of its exports"  # what its export is, for messages: "a GGUF folder (model.gguf)"

    @abstractmethod
    def export(self, model: Any, out: Path, precisions: Sequence[str], **options: Any) -> dict[str, Path]:
        """`model` written under `out` in each of `precisions`; each one's artefact (a file or a folder)."""

    @abstractmethod
    def open(self, artefact: Path, threads: int = 1) -> Any:
        """An exported model loaded for scoring and serving.

        A decoder's scores with `losses(blocks)` (each block's mean next-token loss),
        `token_losses(ids)` and `logits(ids)` (every position of one sequence, prefilled from an
        empty cache: the zero-shot check reads an item's answers from one prefill), and generates
        with `greedy`, `generate_timed` and `start`.
        """

    @abstractmethod
    def time(self, artefacts: Mapping[str, Path], workload: Any) -> dict[str, Any]:
        """Each artefact's timing on `workload`, all timed interleaved in this process."""

    def timer(self, artefact: Path) -> Any:
        """An export loaded for timed greedy generations (`pruneops.timing.generation.TimedGenerator`).

        What `pruneops.runtimes.time_together` interleaves with other runtimes' exports.
        """
        return self.open(artefact).load()

    @abstractmethod
    def contract(self, artefact: Path, metadata: Mapping[str, Any]) -> dict[str, Any]:
        """What requests the artefact serves: two exports with equal contracts serve the same requests."""

    @abstractmethod
    def files(self, artefact: Path) -> list[Path]:
        """Every file the artefact is made of (what a digest of it covers)."""

    @abstractmethod
    def recognises(self, artefact: Path) -> bool:
        """Whether `artefact` is one of this runtime's exports."""

    @abstractmethod
    def versions(self) -> dict[str, str]:
        """The runtime's library versions, recorded beside every figure it timed."""

    def cannot_serve(self, model: Any, **options: Any) -> str | None:
        """Why this runtime cannot export and run `model`'s family, in one phrase (None: it can).

        Asked by the first stage that loads a model, so a family the runtime cannot serve stops
        there and not hours later at export. A runtime that serves every model it is given says None.
        """
        return None

    def check_precisions(self, precisions: Sequence[str]) -> None:
        """Refuses a precision this runtime has not.

        Raises:
            ValueError: One that is not in `precisions`.
        """
        unknown = [p for p in precisions if p not in self.precisions]
        if unknown:
            raise ValueError(f"{self.name}: no precision {unknown[0]!r} (it has {', '.join(self.precisions)})")
