"""`dvc.yaml` from the stage table, with dependencies that cannot go stale.

Each stage depends on the files it really imports inside `pruneops` (the static import closure
of its module and of the stage runner), on the outputs of its upstream stages, on every params key
of its sections, and on the user's own files that params name: the data file (`validate.path`),
the module of a model given as `package.module:factory`, its weights, and the model a latency
target is relative to (`prune.target.reference`). `pruneops dvc-yaml` writes the file;
`--check` (and each stage run under DVC) compares it with what the table and params require.
"""

from __future__ import annotations

import ast
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

import pruneops
from pruneops.config import StageConfig, Task
from pruneops.core.errors import ConfigError
from pruneops.core.io import Layout, replaced_whole
from pruneops.core.params import read_params
from pruneops.pipeline.stages import STAGES, Plot, Stage, load_configs, project_importable, task_of

PACKAGE_DIR = Path(pruneops.__file__).resolve().parent
RELATIVE = Layout(Path("."))  # dvc.yaml paths are relative to the project
HEADER = (
    "# Written by `pruneops dvc-yaml` from the stage table (pruneops/pipeline/stages.py) and params.yaml: edit those\n"
    "# and run it again. Code deps are each stage's imports inside pruneops; a model given as\n"
    "# package.module:factory and the data file are deps of the stages that read them.\n"
)


def _module_file(module: str) -> Path | None:
    """The source file of a `pruneops` module (package `__init__.py` for a package)."""
    parts = module.split(".")[1:]
    base = PACKAGE_DIR.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


# (file, its modification time in ns, its size) -> the pruneops modules it imports: each file is
# parsed once per process while it is unchanged (every stage's closure walks the same files).
_IMPORTS_SEEN: dict[tuple[Path, int, int], frozenset[str]] = {}


def _imported_modules(path: Path, module: str) -> set[str]:
    """`pruneops` modules that `path` imports anywhere (lazy imports inside functions included)."""
    stat = path.stat()
    key = (path, stat.st_mtime_ns, stat.st_size)
    if key not in _IMPORTS_SEEN:
        _IMPORTS_SEEN[key] = frozenset(_parsed_imports(path, module))
    return set(_IMPORTS_SEEN[key])


def _statements(tree: ast.Module) -> Iterator[ast.AST]:
    """Every statement of `tree`, nested ones included (an import is a statement: expressions need no visit)."""
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            todo.extend(getattr(node, field, None) or ())


def _parsed_imports(path: Path, module: str) -> set[str]:
    """`_imported_modules`, read from the file's syntax tree."""
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in _statements(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "pruneops")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] != "pruneops":
                continue
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if _module_file(f"{base}.{a.name}"))
    return found


def module_imports(module: str) -> set[str]:
    """The `pruneops` modules that `module` imports anywhere in its file (lazy imports included)."""
    path = _module_file(module)
    return _imported_modules(path, module) - {module} if path else set()


def import_closure(*modules: str) -> set[Path]:
    """Every file inside `pruneops` that importing `modules` can execute (packages' `__init__` too)."""
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        module = todo.pop()
        parts = module.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
            name = ".".join(parts[:i])
            if name in seen or _module_file(name) is None:
                continue
            seen.add(name)
            todo.extend(_imported_modules(_module_file(name), name))
    return {_module_file(m) for m in seen}


def _dep_path(path: Path, root: Path) -> str:
    """Relative to the project when inside it; absolute otherwise (DVC tracks external files)."""
    path, root = path.resolve(), root.resolve()
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)


def _compress(files: set[Path]) -> list[Path]:
    """Files, with a directory in place of its files when the closure holds every `.py` in it."""
    out = set(files)
    for directory in sorted({f.parent for f in files}, key=lambda d: len(d.parts), reverse=True):
        members = {p for p in directory.rglob("*.py") if "__pycache__" not in p.parts}
        covered = {f for f in out if f.is_relative_to(directory)}
        if directory != PACKAGE_DIR and members and members <= covered | {d for d in out if d.is_dir()}:
            out = {f for f in out if not f.is_relative_to(directory)} | {directory}
    return sorted(out)


def model_module_file(model: str, root: Path) -> Path | None:
    """The file of a user model module (`package.module:factory`); None for registered names or libraries.

    The project root is searched first, as the CLI makes it importable.
    """
    if ":" not in model:
        return None
    with project_importable(root):
        try:
            spec = importlib.util.find_spec(model.partition(":")[0])
        except (ImportError, ValueError):
            spec = None
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin).resolve()
    if any(part in ("site-packages", "dist-packages") for part in origin.parts):
        return None  # an installed library: its version, not its file, is what to pin
    return origin


def _user_paths(stage: Stage, configs: dict[str, StageConfig]) -> list[tuple[str, str]]:
    """(params key, path) of each file the user's params make this stage read (as its task's row names them)."""
    named = []
    for file in stage.impl(task_of(configs)).files:
        value = _param(configs, file.key)
        if value:
            named.append((file.key, Path(value).parent.as_posix() if file.folder else value))
    return named


def _param(configs: dict[str, StageConfig], key: str) -> Any:
    """The value of a dotted params key in validated configs (None where a block on the way is null)."""
    section, *path = key.split(".")
    node: Any = configs.get(section)
    for part in path:
        node = getattr(node, part, None) if node is not None else None
    return node


def _ignore_rules(root: Path) -> list[str]:
    path = root / ".dvcignore"
    if not path.is_file():
        return []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def refuse_untracked(key: str, path: Path, root: Path, shown: str | None = None) -> str:
    """The dependency path of a user file, refused where DVC would not see it change.

    Returns:
        Its path for `dvc.yaml` (relative inside the project, absolute outside: DVC hashes both,
        and follows symlinks).

    Raises:
        ConfigError: The file is a symlink loop, or `.dvcignore` excludes it (there DVC records it
            as empty and never notices a change), or it lies inside `.dvc/` or `.git/`.
    """
    shown = shown or str(path)
    try:
        resolved = path.resolve()
    except (RuntimeError, OSError):  # Python raises RuntimeError for a symlink loop
        raise ConfigError(f"{key}: {shown} is a symlink loop") from None
    rootr = Path(root).resolve()
    dep = _dep_path(resolved, rootr)
    for where in {path.absolute(), resolved}:
        inside = where.is_relative_to(rootr) and where.relative_to(rootr).as_posix()
        if not inside:
            continue
        if inside.split("/")[0] in (".dvc", ".git"):
            raise ConfigError(f"{key}: {shown} lies inside {inside.split('/')[0]}/, which DVC does not track")
        rules = _ignore_rules(rootr)
        if rules:
            import pathspec

            spec = pathspec.PathSpec.from_lines("gitwildmatch", rules)
            if spec.match_file(inside) or spec.match_file(inside + "/"):
                raise ConfigError(
                    f"{key}: {shown} is excluded by .dvcignore (models/ is the model registry, state/ and "
                    "data/feedback/ are runtime state), so DVC would not see it change; put it elsewhere, "
                    "e.g. assets/"
                )
    return dep


def user_files(stage: Stage, configs: dict[str, StageConfig], root: Path) -> list[str]:
    """Files the user's params make this stage read: data, the model's module and weights, a reference model.

    Raises:
        ConfigError: One that DVC would not track (`refuse_untracked`).
    """
    files = [refuse_untracked(key, root / value, root, value) for key, value in _user_paths(stage, configs)]
    if stage.impl(task_of(configs)).builds_model and "train" in configs:
        module = model_module_file(configs["train"].model, root)
        if module is not None:
            files.append(refuse_untracked("train.model", module, root))
    return files


def stage_deps(stage: Stage, configs: dict[str, StageConfig], root: Path) -> list[str]:
    """Everything `stage` depends on besides params: code, upstream outputs, user files."""
    code = import_closure(stage.impl(task_of(configs)).module, "pruneops.pipeline.stages")
    deps = [_dep_path(p, root) for p in _compress(code)]
    deps += [RELATIVE.stage_dir(up).as_posix() for up in stage.upstream]
    return deps + user_files(stage, configs, root)


def stage_params(stage: Stage, task: Task, params: dict[str, Any] | None = None) -> list[str]:
    """Every key of the stage's own section that applies to `task`, then the keys its implementation reads.

    Every stage also depends on `train.task`: the task picks every stage's implementation. With
    the raw `params` (as read from the file), only the keys the file holds: DVC refuses a params
    dependency the file does not hold, and a key left out takes its default from the code, which
    is a dependency already. A key inside a block the file sets to null (`prune.target.kind`
    without a target) names the block instead. A block with keys the stage passes on to a later
    one (`Impl.passes_on`: `prune.gate`'s quality budgets) is listed key by key without them.
    """
    keys = [*_own_keys(stage, task), *stage.impl(task).reads]
    if stage.name != "train":
        keys.append("train.task")
    if params is None:
        return keys
    held = (_held(key, params) for key in keys)
    return list(dict.fromkeys(key for key in held if key is not None))


def _own_keys(stage: Stage, task: Task) -> list[str]:
    """Its own section's keys for `task`: each block whole, or key by key less those it passes on."""
    passed = {tuple(key.split(".", 1)) for key in stage.impl(task).passes_on}
    keys = []
    for name in (k for k in stage.config.model_fields if k in stage.config.keys_for(task)):
        left = {sub for block, sub in passed if block == name}
        if not left:
            keys.append(f"{stage.name}.{name}")
            continue
        block = stage.config.model_fields[name].annotation
        if not (isinstance(block, type) and issubclass(block, StageConfig)):
            raise TypeError(f"{stage.name}.{name}: passes on {sorted(left)}, but it is not a block of keys")
        keys += [f"{stage.name}.{name}.{sub}" for sub in block.model_fields if sub in block.keys_for(task) - left]
    return keys


def _held(key: str, params: dict[str, Any]) -> str | None:
    """`key` as the params file holds it: itself, the null block around it, or None (absent)."""
    parts = key.split(".")
    node: Any = params
    for depth, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
        if node is None:
            return ".".join(parts[: depth + 1])
    return key


def render(root: Path, params_file: str | Path = "params.yaml") -> dict[str, Any]:
    """The `dvc.yaml` mapping for the project at `root` and its params."""
    raw = read_params(Path(root) / params_file)
    with project_importable(root):
        configs = load_configs(raw)
    default = str(params_file) == "params.yaml"
    task = task_of(configs)
    stages = {}
    for stage in STAGES:
        keys = stage_params(stage, task, raw)
        entry: dict[str, Any] = {
            "cmd": f"pruneops {stage.name}" if default else f"pruneops --params {params_file} {stage.name}",
            "deps": stage_deps(stage, configs, Path(root)),
            "params": keys if default else [{str(params_file): keys}],
            "outs": [RELATIVE.stage_dir(stage.name).as_posix()],
            "metrics": [{RELATIVE.metrics(stage.name).as_posix(): {"cache": False}}],
        }
        plots = stage.impl(task).plots
        if plots:
            entry["plots"] = [{(RELATIVE.plots(stage.name) / p.file).as_posix(): _plot(p)} for p in plots]
        stages[stage.name] = entry
    return {"stages": stages}


def _plot(plot: Plot) -> dict[str, Any]:
    """A plot's DVC entry: its axes, or none for a PNG."""
    return {"cache": False, **({"x": plot.x, "y": plot.y} if plot.x else {})}


def write_dvc_yaml(root: Path, params_file: str | Path = "params.yaml") -> Path:
    """Writes `<root>/dvc.yaml` from the table and the params (atomically)."""
    path = Path(root) / "dvc.yaml"
    text = HEADER + yaml.safe_dump(render(root, params_file), sort_keys=False, width=120)
    with replaced_whole(path) as partial:
        partial.write_text(text)
    return path


def _covered(dep: str, declared: list[str]) -> bool:
    return any(dep == d or dep.startswith(d.rstrip("/") + "/") for d in declared)


def _declared_params(entry: dict) -> set[str]:
    keys: set[str] = set()
    for item in entry.get("params", []):
        keys.update([item] if isinstance(item, str) else [k for v in item.values() for k in v])
    return keys


def stage_problems(
    stage: Stage, entry: dict | None, configs: dict[str, StageConfig], root: Path, params: dict[str, Any] | None = None
) -> list[str]:
    """What `dvc.yaml`'s entry for `stage` misses: deps, params (of those `params` holds), outputs."""
    if entry is None:
        return [f"stage {stage.name}: missing from dvc.yaml"]
    declared = [str(d) for d in entry.get("deps", [])]
    problems = [
        f"stage {stage.name}: does not depend on {dep}, which it uses"
        for dep in stage_deps(stage, configs, root)
        if not _covered(dep, declared)
    ]
    listed = _declared_params(entry)
    problems += [
        f"stage {stage.name}: does not list param {key}"
        for key in stage_params(stage, task_of(configs), params)
        if not any(key == name or key.startswith(f"{name}.") for name in listed)  # a listed block holds its keys
    ]
    out = RELATIVE.stage_dir(stage.name).as_posix()
    if out not in entry.get("outs", []):
        problems.append(f"stage {stage.name}: does not declare its output {out}")
    return problems


def check_dvc_yaml(root: Path, params_file: str | Path = "params.yaml", dvc_yaml: Path | None = None) -> list[str]:
    """Everything `dvc.yaml` (default `<root>/dvc.yaml`) misses for the table and params; empty when complete."""
    path = dvc_yaml or Path(root) / "dvc.yaml"
    if not path.is_file():
        return [f"{path}: not found; run `pruneops dvc-yaml`"]
    declared = (yaml.safe_load(path.read_text()) or {}).get("stages", {})
    raw = read_params(Path(root) / params_file)
    with project_importable(root):
        configs = load_configs(raw)
    known = {s.name for s in STAGES}
    problems = [f"stage {name}: in dvc.yaml but not in the stage table" for name in declared if name not in known]
    for stage in STAGES:
        problems += stage_problems(stage, declared.get(stage.name), configs, Path(root), raw)
    return problems


def require_declared_deps(stage: Stage, configs: dict[str, StageConfig], root: Path) -> None:
    """Under `dvc repro` (DVC sets `DVC_STAGE`), refuses to run a stage whose deps are incomplete.

    Raises:
        ConfigError: `dvc.yaml` misses a file the stage uses, so DVC would not notice it change.
    """
    if (Path(root) / ".dvc").is_dir():
        user_files(stage, configs, Path(root))  # a file DVC would not track is refused in or out of DVC
    if os.environ.get("DVC_STAGE") != stage.name:
        return
    path = Path(os.environ.get("DVC_ROOT", root)) / "dvc.yaml"
    if not path.is_file():
        return
    entry = (yaml.safe_load(path.read_text()) or {}).get("stages", {}).get(stage.name)
    missing = [p for p in stage_problems(stage, entry, configs, Path(root)) if "does not depend" in p]
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"dvc.yaml: {missing[0]}{more}; run `pruneops dvc-yaml` so that DVC tracks it")
