"""What every section's config is made of: strict immutable models, bounded types, registry lookups."""

from __future__ import annotations

import importlib
import importlib.util
import re
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from pruneops.core.errors import ConfigError

Ratio = Annotated[float, Field(ge=0.0, lt=1.0)]

Fraction = Annotated[float, Field(gt=0.0, lt=1.0)]

Threads = Annotated[int, Field(ge=1, le=256)]

Epochs = Annotated[int, Field(ge=1, le=10_000)]

BatchSize = Annotated[int, Field(ge=1, le=65_536)]

Seed = Annotated[int, Field(ge=0, lt=2**32)]

LearningRate = Annotated[float, Field(gt=0.0, le=1.0)]

# Names and paths: non-empty, no NUL byte (the OS refuses it), not a novel's length.
Text = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]*$")]


# What each task is called in messages (`train.task`).
TASK_NOUNS = {"classification": "a classifier", "causal_lm": "a causal LM"}


class StageConfig(BaseModel):
    """Base of every stage config: strict types, no unknown keys, finite numbers, immutable.

    `TASK_KEYS` names the keys that apply to one task only (`train.task`); the rest are shared. A
    key of another task than the run's, set in the params file, is refused (`keys_of_other_task`).
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)
    TASK_KEYS: ClassVar[dict[str, frozenset[str]]] = {}
    # Shared keys whose default differs for one task (`with_task_defaults`): what the file leaves
    # unset takes the task's value, e.g. a causal LM's recovery steps 4 token blocks, not 64 images.
    TASK_DEFAULTS: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def keys_for(cls, task: str) -> frozenset[str]:
        """The keys that apply to `task`: the shared ones and its own."""
        others = set().union(*(keys for t, keys in cls.TASK_KEYS.items() if t != task))
        return frozenset(set(cls.model_fields) - others)


def task_keys(**by_task: str) -> dict[str, frozenset[str]]:
    """`TASK_KEYS` from space-separated key names per task."""
    return {task: frozenset(names.split()) for task, names in by_task.items()}


def with_task_defaults(config: StageConfig, task: str) -> StageConfig:
    """`config` with its `TASK_DEFAULTS` for `task` in place of every such key the file did not set."""
    defaults = {k: v for k, v in config.TASK_DEFAULTS.get(task, {}).items() if k not in config.model_fields_set}
    return config.model_copy(update=defaults) if defaults else config


def keys_of_other_task(config: StageConfig, task: str, prefix: str) -> list[tuple[str, str]]:
    """(dotted key, its task) of every key set in the file that applies to another task than `task`.

    Nested blocks are searched too (`prune.target.metric`).
    """
    found = []
    for other, keys in config.TASK_KEYS.items():
        if other != task:
            found += [(f"{prefix}.{key}", other) for key in sorted(keys & config.model_fields_set)]
    for name in sorted(config.model_fields_set):
        value = getattr(config, name)
        if isinstance(value, StageConfig):
            found += keys_of_other_task(value, task, f"{prefix}.{name}")
    return found


def lookup(target: str, name: str) -> Any:
    """Resolves `name` through a registry (or resolver function) given as `module:attribute`.

    The module is named by a string and imported on first use: a name check passes or fails a
    config and cannot change a stage's outputs, so `pruneops.pipeline.dvcfile` does not count the registry
    module among the stage's code dependencies.

    Raises:
        ValueError: Unknown name; the message lists the known ones.
    """
    module, _, attr = target.partition(":")
    found = getattr(importlib.import_module(module), attr)
    try:
        return found(name) if callable(found) and not hasattr(found, "get") else found.get(name)
    except ConfigError as exc:
        raise ValueError(str(exc).removeprefix("train.model: ")) from None


IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def importable(name: str) -> str:
    """`package.module:callable`, checked without running it: the syntax, and that the module exists.

    The module is neither imported nor called here (a config is validated before any stage
    runs, and an import runs the module's code); the stage that builds the model imports it.

    Raises:
        ValueError: Not `package.module:callable`, or no such module.
    """
    if not IMPORT_PATH.match(name):
        raise ValueError(f"{name!r} is not package.module:callable")
    module = name.partition(":")[0]
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        found, why = None, str(exc)
    else:
        why = f"no module named {module!r}"
    if found is None:
        raise ValueError(f"cannot import factory {name!r} ({why})")
    return name


def registered(registry: str, name: str) -> str:
    """`name`, after checking it against `registry` (see `lookup`)."""
    lookup(registry, name)
    return name
