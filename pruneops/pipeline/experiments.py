"""Variants and re-prunes as DVC experiments, never by rewriting the user's `params.yaml`.

An experiment runs in its own git worktree of the project, made from the workspace as
`dvc exp run` takes it (HEAD plus uncommitted changes to tracked files, and the workspace's
`params.yaml`), and shares the project's DVC cache, so the run-cache restores every stage whose
code, data and params did not change (the baseline is trained once). The overrides go into the
worktree's `params.yaml`, its `dvc.yaml` is written for them (`pruneops.pipeline.dvcfile`), and
`dvc exp run` runs it and records it in the project's git refs (`dvc exp show -A`).

`project_lock` is the one lock that every flow which runs stages in a project takes.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from pruneops.config.base import IMPORT_PATH
from pruneops.core.errors import ConfigError, PruneOpsError
from pruneops.core.io import Layout, read_json
from pruneops.core.params import read_params
from pruneops.pipeline.runner import read_outcome
from pruneops.pipeline.stages import STAGE_NAMES, load_configs, project_importable

LOCK_FILE = "stages.lock"
STALE_LOCK_S = 6 * 3600


class LockHeld(PruneOpsError):
    """Another flow is running stages in this project."""


class ExperimentFailed(PruneOpsError):
    """`dvc exp run` failed; the message carries the failing stage's error line."""


def tool_env(pythonpath: tuple[Path, ...] = ()) -> dict[str, str]:
    """The environment for dvc/git/pruneops: this interpreter's bin first, analytics off, a git identity.

    Args:
        pythonpath: Directories the stages must import from (where a model module lives).
    """
    bin_dir = str(Path(sys.executable).parent)
    paths = [str(Path(p).resolve()) for p in pythonpath] + [p for p in [os.environ.get("PYTHONPATH", "")] if p]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(paths),
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
        "DVC_NO_ANALYTICS": "1",
        "GX_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
    }
    # `dvc exp run` commits the experiment; a fresh machine may have no git identity.
    for key, value in (("GIT_AUTHOR_NAME", "pruneops"), ("GIT_AUTHOR_EMAIL", "pruneops@localhost")):
        env.setdefault(key, value)
        env.setdefault(key.replace("AUTHOR", "COMMITTER"), value)
    return env


def run_logged(
    cmd: list[str], cwd: Path, log: Callable[[str], None], tail: int = 40, env: dict[str, str] | None = None
) -> tuple[int, list[str]]:
    """Runs `cmd`, passing each output line to `log` as it comes; returns (exit code, last lines)."""
    lines: list[str] = []
    with subprocess.Popen(
        cmd, cwd=cwd, env=env or tool_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        for line in proc.stdout:
            line = line.rstrip()
            log(line)
            if line.strip():  # the tail names the error: blank lines would hide it
                lines = [*lines[-(tail - 1) :], line]
    return proc.returncode, lines


def _git(cwd: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, env=tool_env(), capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise PruneOpsError(f"git {' '.join(args)} failed in {cwd}: {out.stderr.strip().splitlines()[-1:]}")
    return out.stdout.strip()


@contextmanager
def project_lock(root: Path, holder: str) -> Iterator[None]:
    """Holds the project's stage lock while the block runs (one flow at a time runs stages).

    Raises:
        LockHeld: Another live holder has it (a lock older than `STALE_LOCK_S` is taken over).
    """
    state = Layout(Path(root)).state_dir()
    state.mkdir(parents=True, exist_ok=True)
    lock = state / LOCK_FILE
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)  # left by a run that died
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        raise LockHeld(f"another flow is running stages in {root} ({lock.read_text().strip()})") from None
    try:
        os.write(fd, f"{holder} pid {os.getpid()} since {time.strftime('%H:%M:%S')}\n".encode())
        os.close(fd)
        yield
    finally:
        lock.unlink(missing_ok=True)


def refuse_code(key: str, value: Any) -> None:
    """Refuses an override that names code (`package.module:callable`).

    Overrides come from whoever can start a flow run; code that a stage imports and calls is
    named in `params.yaml` only, which is reviewed and versioned with the project. Registry names
    (`prune.method: channel`) stay allowed: they choose among code already installed.

    Raises:
        ConfigError: (exit 2) The value, or a string inside it, has the form `module:callable`.
    """
    strings = [value] if isinstance(value, str) else _strings_in(value)
    if any(IMPORT_PATH.match(s) for s in strings):
        raise ConfigError(
            f"override {key!r}: a value naming code (package.module:callable) is read from params.yaml only"
        )


def _strings_in(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [*_strings_in(k), *_strings_in(v)]]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings_in(v)]
    return []


def apply_overrides(params: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """A copy of `params` with dotted overrides set, validated as a whole.

    A key is `section.key`, or deeper into a nested block (`prune.target.value`); a block that
    is null or absent is created around the key.

    Raises:
        ConfigError: An override names no key, or makes the params invalid.
    """
    out = copy.deepcopy(params)
    for key, value in overrides.items():
        refuse_code(key, value)
        section, *path = key.split(".")
        if not path or not all(path):
            raise ConfigError(f"override {key!r}: expected section.key")
        node = out
        for depth, part in enumerate([section, *path[:-1]]):
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                raise ConfigError(f"override {key!r}: {'.'.join([section, *path][: depth + 1])} is not a mapping")
            node = node[part]
        node[path[-1]] = value
    load_configs(out)
    return out


@dataclass(frozen=True)
class Experiment:
    """A finished experiment: its worktree holds the outputs until `remove()`."""

    name: str
    root: Path
    repo_root: Path
    project: Path

    @property
    def layout(self) -> Layout:
        """Where its stages wrote."""
        return Layout(self.root)

    def metrics(self) -> dict[str, dict]:
        """Each stage's metrics."""
        return {s: read_json(self.layout.metrics(s)) for s in STAGE_NAMES if self.layout.metrics(s).exists()}

    def stages_run(self) -> list[str]:
        """The stages that ran in it (each records how it ended); DVC restored or kept the others."""
        return [s for s in STAGE_NAMES if read_outcome(self.root, s) is not None]

    def failure(self) -> str | None:
        """The error line of the stage that failed in it, as that stage printed it; None if none did."""
        failed = [o for o in map(partial(read_outcome, self.root), STAGE_NAMES) if o is not None and o.exit_code]
        return failed[-1].error if failed else None

    def remove(self) -> None:
        """Deletes the worktree (the experiment stays in git refs and its outputs in the cache)."""
        _remove_worktree(self.project, self.repo_root)


def _remove_worktree(project: Path, tree: Path) -> None:
    subprocess.run(
        ["git", "worktree", "remove", "--force", str(tree)],
        cwd=project,
        env=tool_env(),
        capture_output=True,
        check=False,
    )
    shutil.rmtree(tree, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=project, env=tool_env(), capture_output=True, check=False)


def _dvc(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "dvc"), *args]


def _make_worktree(project: Path, name: str, replace: bool = False) -> tuple[Path, Path]:
    """A worktree of the workspace state under `state/experiments/<name>`: (its repo root, its project dir).

    With `replace`, a worktree of that name is removed first: a run killed by a signal (a
    stopped `pruneops bench`) leaves its worktree behind, and the rerun meant to replace it would
    otherwise refuse the variant (a benchmark then lost its dense reference that way). Its
    `state/cache` is the project's (`_share_cache`).
    """
    top = Path(_git(project, "rev-parse", "--show-toplevel")).resolve()
    try:
        _git(project, "rev-parse", "--verify", "HEAD")
    except PruneOpsError:
        raise PruneOpsError(f"{project}: DVC experiments need a git commit; commit the project first") from None
    base = _git(project, "stash", "create") or "HEAD"  # uncommitted changes, without touching them
    tree = Layout(project).state_dir() / "experiments" / name
    if tree.exists() and replace:
        _remove_worktree(project, tree)
    if tree.exists():
        raise PruneOpsError(f"{tree}: an experiment named {name!r} is already there")
    tree.parent.mkdir(parents=True, exist_ok=True)
    _git(project, "worktree", "add", "--detach", str(tree), base)
    root = tree / project.resolve().relative_to(top)
    _share_cache(project, root)
    return tree, root


def _share_cache(project: Path, root: Path) -> None:
    """Points the worktree's `state/cache` at the project's: recovery checkpoints and exports' scores.

    What is there is named by its inputs, so every experiment of the project shares it, and it
    outlives a worktree that a rerun replaces or a failure removes (a stopped recovery resumes).
    """
    shared = Layout(project).state_dir() / "cache"
    shared.mkdir(parents=True, exist_ok=True)
    own = Layout(root).state_dir()
    own.mkdir(parents=True, exist_ok=True)
    (own / "cache").symlink_to(shared.resolve(), target_is_directory=True)


def run_experiment(
    project: Path,
    overrides: dict[str, Any],
    name: str,
    log: Callable[[str], None] = print,
    pythonpath: tuple[Path, ...] = (),
    replace: bool = False,
) -> Experiment:
    """Runs the pipeline with `overrides` as a DVC experiment in a worktree of `project`.

    Args:
        project: The PruneOps project (its `params.yaml` is read, never written).
        overrides: Dotted params keys and values (validated before anything runs).
        name: The experiment's name (worktree directory and `dvc exp` name).
        log: Where `dvc exp run`'s output lines go.
        pythonpath: Directories the stages import from besides the worktree (a model's module).
        replace: Remove an earlier experiment of the same name first (a re-run of a benchmark
            after an interruption); without it, `dvc exp run` refuses the name.

    Returns:
        The experiment, its outputs in its worktree (call `remove()` when done with them).

    Raises:
        ConfigError: An override is invalid (nothing was created).
        ExperimentFailed: A stage failed; the worktree is removed.
    """
    from pruneops.pipeline.dvcfile import write_dvc_yaml

    project = Path(project).resolve()
    with project_importable(project, *pythonpath):
        params = apply_overrides(read_params(project / "params.yaml"), overrides)
    cache = subprocess.run(_dvc("cache", "dir"), cwd=project, env=tool_env(), capture_output=True, text=True)
    tree, root = _make_worktree(project, name, replace)
    experiment = Experiment(name, root, tree, project)
    try:
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        with project_importable(*pythonpath):
            write_dvc_yaml(root)
        if cache.returncode == 0 and cache.stdout.strip():
            subprocess.run(_dvc("cache", "dir", "--local", cache.stdout.strip()), cwd=root, env=tool_env(), check=True)
        if replace:  # absent is fine: the exit code is not checked
            subprocess.run(_dvc("exp", "remove", name), cwd=root, env=tool_env(), capture_output=True)
        code, tail = run_logged(_dvc("exp", "run", "--name", name), root, log, env=tool_env(pythonpath))
        if code != 0:  # the failing stage's own line, else DVC's last (it stopped before any stage failed)
            raise ExperimentFailed(f"experiment {name} failed: {experiment.failure() or (tail or ['no output'])[-1]}")
    except BaseException:
        experiment.remove()
        raise
    return experiment
