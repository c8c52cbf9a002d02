"""Parameter overrides written into params.yaml (comments kept), validated before they land."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

from prefect import task
from ruamel.yaml import YAML

from pruneops.config import EXTRA_SECTIONS, STAGE_CONFIGS, RepruneConfig, check_sections, parse_section, read_params


def set_dotted(tree: Any, key: str, value: Any) -> None:
    """Sets `section.key` (or deeper) in a nested mapping."""
    *path, leaf = key.split(".")
    node = tree
    for part in path:
        node = node[part]
    node[leaf] = value


def reprune_config(project_dir: str | Path) -> RepruneConfig:
    """The validated `reprune` section of a project's params.yaml."""
    params = read_params(Path(project_dir) / "params.yaml")
    return parse_section("reprune", params.get("reprune"), RepruneConfig)


@task(task_run_name="set-params")
def apply_overrides(project_dir: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """Writes `{"prune.target_ratio": 0.7, ...}` into params.yaml, like `dvc exp run -S`.

    Raises:
        pruneops.errors.ConfigError: An override is unknown or invalid; params.yaml is unchanged.
    """
    path = Path(project_dir) / "params.yaml"
    yaml = YAML()
    tree = yaml.load(path.read_text())
    for key, value in overrides.items():
        set_dotted(tree, key, value)
    plain = json.loads(json.dumps(tree))
    check_sections(plain)
    for name, cls in {**STAGE_CONFIGS, **EXTRA_SECTIONS}.items():
        parse_section(name, plain.get(name), cls)
    buffer = io.StringIO()
    yaml.dump(tree, buffer)
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(buffer.getvalue())
    os.replace(tmp, path)
    return overrides
