"""The package's layers: imports go down only, no circles, no stage imports another, modules stay small."""

from __future__ import annotations

from pathlib import Path

import pytest

import pruneops
from pruneops.core.params import read_params
from pruneops.pipeline.dvcfile import module_imports, stage_deps
from pruneops.pipeline.stages import STAGES, load_configs

ROOT = Path(pruneops.__file__).parent
MAX_LINES = 600
# Packages below the stages: what they import may not be a stage, `pruneops bench` or an entry point.
LOWER = ("pruneops.timing", "pruneops.planning", "pruneops.pruning", "pruneops.models", "pruneops.data")
UPPER = (
    "pruneops.task.",
    "pruneops.compare",
    "pruneops.cli",
    "pruneops.pipeline.runner",
    "pruneops.pipeline.experiments",
)


def _modules() -> list[str]:
    names = []
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


GRAPH = {m: module_imports(m) for m in _modules()}


def _cycle() -> list[str] | None:
    """One import circle among `pruneops` modules, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for dep in sorted(GRAPH.get(module, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep] if dep in path else [module, dep]
            if dep in GRAPH and dep not in state:
                found = visit(dep, [*path, dep])
                if found:
                    return found
        state[module] = 2
        return None

    for module in GRAPH:
        if module not in state:
            found = visit(module, [module])
            if found:
                return found
    return None


def test_no_module_imports_itself_back_through_others():
    assert _cycle() is None, " -> ".join(_cycle() or [])


def test_a_cycle_is_found_where_there_is_one():
    GRAPH["pruneops.core.errors"].add("pruneops.task.classification.prune")
    try:
        cycle = _cycle()
    finally:
        GRAPH["pruneops.core.errors"].discard("pruneops.task.classification.prune")
    assert cycle is not None and "pruneops.core.errors" in cycle


def test_no_stage_imports_another_stage():
    stages = {m for s in STAGES for m in s.modules}
    for stage in stages:
        assert not (GRAPH[stage] & (stages - {stage})), (stage, GRAPH[stage] & stages)


@pytest.mark.parametrize("package", LOWER)
def test_lower_layers_never_import_a_stage_the_bench_or_an_entry_point(package):
    for module, deps in GRAPH.items():
        if module == package or module.startswith(package + "."):
            upward = sorted(d for d in deps if d.startswith(UPPER))
            assert not upward, (module, upward)


def test_no_module_is_over_the_size_limit():
    sizes = {p: len(p.read_text().splitlines()) for p in ROOT.rglob("*.py")}
    assert all(n <= MAX_LINES for n in sizes.values()), {str(p): n for p, n in sizes.items() if n > MAX_LINES}


def test_editing_a_pruning_method_does_not_retrain_the_baseline():
    """`train`'s DVC deps are its import closure: the pruning methods are `prune`'s, not `train`'s."""
    project = ROOT.parent
    configs = load_configs(read_params(project / "params.yaml"))
    deps = {s.name: stage_deps(s, configs, project) for s in STAGES}
    assert "pruneops/pruning/methods.py" not in deps["train"]
    assert any(d in ("pruneops/pruning", "pruneops/pruning/methods.py") for d in deps["prune"]), deps["prune"]


def test_config_validation_looks_registries_up_below_the_stages():
    """Params validation names registries by `module:NAME`; none may make loading params import a stage."""
    for module in (ROOT / "config").glob("*.py"):
        assert '"pruneops.pipeline.stages.' not in module.read_text(), module


def test_nothing_is_loose_at_the_package_root_but_the_cli_and_init():
    loose = sorted(p.name for p in ROOT.glob("*.py"))
    assert loose == ["__init__.py", "cli.py"]


def test_only_the_library_is_installed_not_the_prefect_layer():
    """`flows` and `tasks` stay at the repository's top level, never site-packages of those names."""
    tomllib = pytest.importorskip("tomllib")
    from setuptools import find_packages

    repo = ROOT.parent
    found = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    installed = find_packages(where=str(repo), include=found["include"], exclude=found.get("exclude", ()))
    assert installed and all(name.split(".")[0] == "pruneops" for name in installed), installed
    assert {"flows", "tasks"} <= {p.name for p in repo.iterdir() if p.is_dir()}
    assert not (repo / "scripts").exists(), "studies live in studies/, harnesses under tests/"
