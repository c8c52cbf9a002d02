"""Runtimes behind one protocol (`pruneops.runtimes.base.Runtime`): one folder and one line of `RUNTIMES` each.

Only `pruneops/runtimes/<name>/` imports its runtime's library (a test holds every other module
to that). The stages of a task import their runtime's package directly, so that a stage's DVC
dependencies include the runtime code it runs; what serves any task (the model store, serving,
`pruneops bench`) finds a runtime here by name.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from pruneops.core.errors import ConfigError

if TYPE_CHECKING:
    from pruneops.runtimes.base import Runtime


class RuntimeEntry(NamedTuple):
    """A runtime's registry line.

    Attributes:
        target: The `module:attribute` of its `Runtime` (imported when asked for).
        library: The library that its folder alone may import.
        task: The `train.task` of the models it runs.
    """

    target: str
    library: str
    task: str


# One line per runtime.
RUNTIMES: dict[str, RuntimeEntry] = {
    "onnxruntime": RuntimeEntry("pruneops.runtimes.onnxruntime:RUNTIME", "onnxruntime", "classification"),
    "genai": RuntimeEntry("pruneops.runtimes.genai:RUNTIME", "onnxruntime_genai", "causal_lm"),
    "llamacpp": RuntimeEntry("pruneops.runtimes.llamacpp:RUNTIME", "llama_cpp", "causal_lm"),
}
LIBRARIES: dict[str, str] = {name: entry.library for name, entry in RUNTIMES.items()}


def get_runtime(name: str) -> Runtime:
    """The runtime registered as `name`.

    Raises:
        ConfigError: No such runtime (the message lists them).
    """
    if name not in RUNTIMES:
        raise ConfigError(f"unknown runtime {name!r}; runtimes: {', '.join(RUNTIMES)}")
    module, _, attr = RUNTIMES[name].target.partition(":")
    return getattr(importlib.import_module(module), attr)


def runtime_names(task: str) -> list[str]:
    """The names of the runtimes that run `task`'s models, in registry order, nothing imported."""
    return [name for name, entry in RUNTIMES.items() if entry.task == task]


def causal_lm_runtime(name: str) -> str:
    """`name`, where it is `auto` or a runtime of causal LMs (`export.runtime`'s check).

    Raises:
        ConfigError: Any other name (the message lists the choices).
    """
    names = runtime_names("causal_lm")
    if name != "auto" and name not in names:
        raise ConfigError(f"unknown runtime {name!r}; choose auto or one of {', '.join(names)}")
    return name


def runtimes_for(task: str) -> list[Runtime]:
    """The runtimes that run `task`'s models, in registry order (the first is the task's default)."""
    return [get_runtime(name) for name in runtime_names(task)]


def runtime_of(artefact: Path, task: str) -> Runtime:
    """The runtime of `task` whose export `artefact` is (the first in registry order that recognises it).

    Raises:
        ConfigError: None recognises it (the message names what each runtime's export holds).
    """
    for runtime in runtimes_for(task):
        if runtime.recognises(Path(artefact)):
            return runtime
    raise ConfigError(f"{artefact} is not {' nor '.join(r.export_kind for r in runtimes_for(task))}")
