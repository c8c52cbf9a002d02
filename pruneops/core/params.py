"""Reading params files into configs, with one-line errors naming the first bad key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from pruneops.config import EXTRA_SECTIONS, StageConfig
from pruneops.config.base import IMPORT_PATH
from pruneops.core.errors import ConfigError

C = TypeVar("C", bound=StageConfig)


def environment_overrides(text: str) -> dict[str, Any]:
    """`"reprune.drift_source=http://x serve.max_batch=64"` -> dotted keys and YAML-parsed values.

    Only the orchestration sections (`EXTRA_SECTIONS`) may be set this way: stage params change
    results, so they change through DVC experiments, where they are recorded.

    Raises:
        ConfigError: Not `section.key=value`, or a stage section.
    """
    overrides = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        section, _, leaf = key.partition(".")
        if not sep or not leaf:
            raise ConfigError(f"PRUNEOPS_SET: expected section.key=value, got {item!r}")
        if section not in EXTRA_SECTIONS:
            raise ConfigError(
                f"PRUNEOPS_SET: {key}: only {', '.join(EXTRA_SECTIONS)} keys can be set here; "
                "stage params change through a DVC experiment (the pipeline flow's overrides)"
            )
        try:
            overrides[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ConfigError(f"PRUNEOPS_SET: {key}: value {value[:80]!r} is not valid YAML") from None
        if isinstance(overrides[key], str) and IMPORT_PATH.match(overrides[key]):
            raise ConfigError(f"PRUNEOPS_SET: {key}: a value naming code (package.module:callable) is refused")
    return overrides


def read_params(path: str | Path) -> dict[str, Any]:
    """Reads a params file as a mapping of sections.

    `PRUNEOPS_SET` in the environment (a container's deployment settings) overlays keys of the
    orchestration sections in memory; the file is never written.

    Raises:
        ConfigError: The file is missing, not YAML, or not a mapping.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: params file not found") from None
    except OSError as exc:  # a directory, no permission...
        raise ConfigError(f"{path}: cannot read the params file ({exc.strerror or exc})") from None
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a mapping of stage sections")
    for key, value in environment_overrides(os.environ.get("PRUNEOPS_SET", "")).items():
        section, _, leaf = key.partition(".")
        if not isinstance(data.setdefault(section, {}), dict):
            raise ConfigError(f"{path}: section {section!r} must be a mapping")
        data[section][leaf] = value
    return data


def _fields_at(cls: type[BaseModel], loc: tuple) -> list[str]:
    """The keys allowed where an unknown key was found: the section's, or a nested config's."""
    for part in loc:
        field = cls.model_fields.get(str(part))
        if field is None:
            break
        options = getattr(field.annotation, "__args__", (field.annotation,))  # X | None -> (X, None)
        models = [a for a in options if isinstance(a, type) and issubclass(a, BaseModel)]
        if not models:
            break
        cls = models[0]
    return list(cls.model_fields)


def _describe(section: str, error: dict[str, Any], cls: type[StageConfig]) -> str:
    loc = ".".join(str(p) for p in error["loc"])
    key = f"{section}.{loc}" if loc else section
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown key; allowed keys: {', '.join(_fields_at(cls, error['loc'][:-1]))}"
    msg = error["msg"].replace("Input should be", "must be").replace("Value error, ", "")
    if not loc:  # a check across keys: its message starts with the key it is about
        return f"{section}.{msg}"
    if error["type"] == "value_error" and isinstance(error.get("input"), dict):  # across a nested block's keys
        return f"{key}.{msg}"
    return f"{key}: {msg} (got {_short(error.get('input'))})"


def _short(value: Any, limit: int = 80) -> str:
    """A value as an error message shows it: its repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 1]}… ({len(text)} characters)"


def parse_section(section: str, raw: Any, cls: type[C]) -> C:
    """Validates one section of params into its config model.

    Raises:
        ConfigError: One line naming the first bad key and what is allowed.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{section}: must be a mapping of keys, got {type(raw).__name__}")
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ConfigError(_describe(section, errors[0], cls) + more) from None
