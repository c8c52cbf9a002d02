"""The guide stays true: every block marked runnable in the README and the tutorials runs, and the site builds.

A block is marked by a `<!-- runnable -->` line right above its fence:
- `python` whose first line is `# file: PATH`: a file the recipe's project holds;
- `yaml`: params keys over the project's params (section by section, as a user edits the file),
  validated, and run through every stage on tiny data (the training budgets cut to the tiny
  ones; a text recipe's data and pretrained folder replaced by tiny stand-ins, a few seconds each);
- `bash`: commands run one per line in a project where every stage has run.
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from pruneops.core.params import read_params
from pruneops.pipeline.dvcfile import render
from pruneops.pipeline.runner import run_stage
from pruneops.pipeline.stages import STAGE_NAMES, load_configs
from tests.conftest import ROOT, TINY_OVERRIDES, tiny_params, write_params

MARK = "<!-- runnable -->"
GUIDES = [ROOT / "README.md", *sorted((ROOT / "docs" / "tutorial").glob("*.md"))]
# The keys a recipe's run on tiny data takes from the tiny params instead of the block.
TINY_BUDGET = {"train": ("epochs",), "finetune": ("epochs",)}


@dataclass(frozen=True)
class Block:
    """One runnable block: where it is, its language and its text."""

    path: Path
    line: int
    lang: str
    text: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def runnable_blocks(path: Path) -> list[Block]:
    """The blocks of `path` marked runnable, in order."""
    lines = path.read_text().splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.strip() != MARK:
            continue
        fence = re.match(r"^```(\w+)$", lines[i + 1].strip())
        assert fence, f"{path.name}:{i + 1}: {MARK} must be followed by a fenced block"
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
        found.append(Block(path, i + 2, fence.group(1), "\n".join(lines[i + 2 : end]) + "\n"))
    return found


BLOCKS = [b for guide in GUIDES for b in runnable_blocks(guide)]


@dataclass(frozen=True)
class Recipe:
    """A params block with the files the blocks before it (since the last params block) hold."""

    params: Block
    files: dict[str, str]

    @property
    def overrides(self) -> dict:
        return yaml.safe_load(self.params.text)


def recipes() -> list[Recipe]:
    found = []
    for guide in GUIDES:
        files: dict[str, str] = {}
        for block in runnable_blocks(guide):
            if block.lang == "python":
                files[block.text.splitlines()[0].removeprefix("# file: ").strip()] = block.text
            elif block.lang == "yaml":
                found.append(Recipe(block, files))
                files = {}
    return found


RECIPES = recipes()


def test_the_guides_have_runnable_blocks_of_known_kinds():
    assert {b.path.name for b in BLOCKS} >= {"README.md", "your-own-model.md", "first-run.md"}
    for block in BLOCKS:
        assert block.lang in ("python", "yaml", "bash"), block.name
        if block.lang == "python":
            assert block.text.startswith("# file: "), f"{block.name}: a python block names its file"
    assert len(RECIPES) >= 4


README_MAX_LINES = 250  # the first screen is the two set-up commands and the library example


def test_the_readme_stays_a_readme():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the rest belongs in docs/"
    assert any("make run" in line for line in lines[:20]) and any("make test" in line for line in lines[:20])


def _project(recipe: Recipe, root: Path, tiny: bool, extra: dict | None = None) -> Path:
    """Writes the recipe's files and params (over the tiny params, then `extra`) into `root`."""
    for name, text in recipe.files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
        (root / name).parent.joinpath("__init__.py").touch()
    params = tiny_params()
    for section, values in recipe.overrides.items():
        params[section].update(copy.deepcopy(values))
    if tiny:
        for section, keys in TINY_BUDGET.items():
            for key in keys:
                params[section][key] = TINY_OVERRIDES[section][key]
    for section, values in (extra or {}).items():
        params[section].update(values)
    return write_params(root, params)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.params.name)
def test_every_params_block_is_valid_params_and_a_complete_dvc_yaml(recipe, tmp_path, monkeypatch):
    path = _project(recipe, tmp_path, tiny=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    configs = load_configs(read_params(path))
    assert set(recipe.overrides) <= set(configs)
    for section, values in recipe.overrides.items():  # every key the block sets is read as written
        for key, value in values.items():
            assert _reads_as(getattr(configs[section], key), value), (recipe.params.name, section, key)
    stages = render(tmp_path)["stages"]
    assert list(stages) == list(STAGE_NAMES)


def _reads_as(got, value) -> bool:
    """Whether a loaded config value is what the block wrote (a nested block: the keys it set)."""
    if hasattr(got, "model_dump"):
        got = got.model_dump()
    if isinstance(value, dict):
        return isinstance(got, dict) and all(_reads_as(got.get(k), v) for k, v in value.items())
    if isinstance(value, list):
        return list(got) == value
    return got == value


def _stand_ins(root: Path, overrides: dict) -> dict | None:
    """Tiny stand-ins for a recipe's files, and the params they need; None where none can stand in.

    A text recipe's table becomes 300 made-up reviews whose first word gives the label, and its
    pretrained folder a randomly initialised 2-layer BERT: a model that is not pretrained learns
    at a higher rate than a pretrained one is fine-tuned at, so the stand-in trains at 1e-3.
    """
    validate, train = overrides.get("validate", {}), overrides.get("train", {})
    if validate.get("dataset") == "text":
        pytest.importorskip("transformers", reason="transformers (the `hf` extra) is not installed")
        from tests.text_helpers import make_reviews, tiny_pretrained

        data = root / validate["path"]
        data.parent.mkdir(parents=True, exist_ok=True)
        make_reviews(300).to_csv(data, index=False)
        tiny_pretrained(root / train["pretrained"])
        if validate.get("tokenizer") != train.get("pretrained"):
            tiny_pretrained(root / validate["tokenizer"])
        return {"train": {"lr": 1e-3, "batch_size": 16}}
    return {} if validate.get("dataset") in (None, "digits") else None


@pytest.mark.slow(
    reason="all nine stages once per params block (about 11 s each); each block is checked as params in make test"
)
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.params.name)
def test_every_params_block_prunes_and_benchmarks_a_model_on_tiny_data(recipe, tmp_path, monkeypatch):
    extra = _stand_ins(tmp_path, recipe.overrides)
    if extra is None:
        pytest.skip(f"{recipe.params.name}: its data ({recipe.overrides['validate'].get('path')}) has no tiny stand-in")
    path = _project(recipe, tmp_path, tiny=True, extra=extra)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)  # the params' relative paths are the project's, as under `dvc repro`
    for stage in STAGE_NAMES:
        run_stage(stage, path, tmp_path)
    assert (tmp_path / "artifacts/export/pruned_deployed.onnx").is_file()
    table = (tmp_path / "artifacts/benchmark/benchmark.md").read_text()
    assert "| dense_fp32" in table and "| pruned_deployed" in table


BASH = [b for b in BLOCKS if b.lang == "bash"]


@pytest.mark.parametrize("block", BASH, ids=lambda b: b.name)
def test_every_command_block_runs_in_a_project_where_the_stages_ran(block, pipeline_dir, tmp_path):
    project = tmp_path / "project"
    shutil.copytree(pipeline_dir, project)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for line in block.text.splitlines():
        command = line.split("#", 1)[0].strip()
        if not command:
            continue
        done = subprocess.run(command, shell=True, cwd=project, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{block.name}: `{command}` exited {done.returncode}: {done.stderr[-2000:]}"


def test_the_site_builds_with_strict_links_and_anchors(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs (the `docs` extra) is not installed")
    mkdocs = Path(sys.executable).parent / "mkdocs"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
