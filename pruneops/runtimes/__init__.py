"""Runtimes behind one protocol (`pruneops.runtimes.base.Runtime`): one folder and one line of `RUNTIMES` each.

Only `pruneops/runtimes/<name>/` imports its runtime's library (a test holds every other module
to that). The stages of a task import their runtime's package directly, so that a stage's DVC
dependencies include the runtime code it runs; what serves any task (the model store, serving,
`pruneops bench`) finds a runtime here by name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, NamedTuple

from pruneops.core.errors import ConfigError

if TYPE_CHECKING:
    from pruneops.runtimes.base import Runtime


class RuntimeEntry(NamedTuple):
    """A runtime's registry line.

    Attributes:
        target: The `module:attribute` of its `Runtime` (imported when asked for).
        library: The library that its folder alone may import.
    """

    target: str
    library: str


# One line per runtime.
RUNTIMES: dict[str, RuntimeEntry] = {
    "onnxruntime": RuntimeEntry("pruneops.runtimes.onnxruntime:RUNTIME", library="onnxruntime"),
    "genai": RuntimeEntry("pruneops.runtimes.genai:RUNTIME", library="onnxruntime_genai"),
    "llamacpp": RuntimeEntry("pruneops.runtimes.llamacpp:RUNTIME", library="llama_cpp"),
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


def runtimes_for(task: str) -> list[Runtime]:
    """The runtimes that run `task`'s models, in registry order (the first is the task's default)."""
    return [runtime for runtime in map(get_runtime, RUNTIMES) if runtime.task == task]
