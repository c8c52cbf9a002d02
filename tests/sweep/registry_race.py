"""Concurrent writers on one model registry: every operation recorded once, production == top of history.

Each repetition registers a few versions, then starts `--processes` real processes that each run
`--operations` random promotions and rollbacks against the same registry. Every operation that
returns is written to its process's log with a unique id (the reason it passes); afterwards
history must hold exactly those ids (none lost, none doubled), parse, and end at the version the
`production` symlink points at.

python tests/sweep/registry_race.py [--processes 2] [--operations 100] [--repetitions 20]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
VERSIONS = ("v0", "v1", "v2", "v3")


def worker(registry_dir: Path, name: str, operations: int, log: Path, unlocked: bool = False) -> None:
    """Runs random operations; logs the id of each one that returned (`unlocked`: without the lock)."""
    import contextlib

    from pruneops.modelstore.store import ModelRegistry, RegistryError

    registry = ModelRegistry(registry_dir)
    if unlocked:  # what the race looks like without the lock: shows that this check can fail
        registry._locked = contextlib.nullcontext
    _start_together(log)
    rng = random.Random(name)
    done = []
    for i in range(operations):
        op_id = f"{name}-{i}"
        try:
            if rng.random() < 0.6:
                registry.promote(rng.choice(VERSIONS), op_id)
            else:
                registry.rollback(op_id)
        except RegistryError as exc:
            if unlocked or "nothing to roll back" in str(exc):
                continue
            raise
        done.append(op_id)
    log.write_text(json.dumps(done))


def _start_together(log: Path, timeout_s: float = 120.0) -> None:
    """Says this worker is ready, then waits for the go file: the processes race from their first operation.

    Without it a worker on a loaded machine may finish before the other has imported pruneops, and
    the race never happens.
    """
    log.with_suffix(".ready").touch()
    go = log.parent / "go"
    deadline = time.monotonic() + timeout_s
    while not go.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{log.stem}: no go file after {timeout_s:.0f} s")
        time.sleep(0.005)


def _release_when_ready(procs: list[subprocess.Popen], logs: list[Path], timeout_s: float = 120.0) -> None:
    """Writes the go file once every worker is ready (or one has exited, whose code the tally reports)."""
    deadline = time.monotonic() + timeout_s
    while not all(log.with_suffix(".ready").exists() for log in logs):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            break
        time.sleep(0.005)
    (logs[0].parent / "go").touch()


def repetition(work: Path, processes: int, operations: int, unlocked: bool = False) -> dict:
    """One race; returns its tally."""
    from pruneops.modelstore.store import ModelRegistry, served_stack
    from tests.conftest import tiny_onnx

    registry = ModelRegistry(work / "models")
    for seed, version in enumerate(VERSIONS):
        registry.register(tiny_onnx(work / f"{version}.onnx", seed), {}, version=version)
    registry.promote("v0", "start")
    logs = [work / f"p{n}.json" for n in range(processes)]
    cmd = [sys.executable, __file__, "--worker", str(registry.root), "--operations", str(operations)]
    cmd += ["--unlocked"] if unlocked else []
    procs = [subprocess.Popen([*cmd, "--name", f"p{n}", "--log", str(log)]) for n, log in enumerate(logs)]
    _release_when_ready(procs, logs)
    codes = [p.wait() for p in procs]
    done = [op for log in logs if log.exists() for op in json.loads(log.read_text())]
    try:
        history = registry.history()
        corrupt = 0
    except Exception:  # noqa: BLE001 - counted: an unreadable history is what this measures
        history, corrupt = [], 1
    recorded = [e["reason"] for e in history if e.get("reason") != "start"]
    stack = served_stack(history)
    linked = Path(os.readlink(registry.production_link)).name if registry.production_link.is_symlink() else None
    return {
        "exit_codes": codes,
        "operations": len(done),
        "lost": len(set(done) - set(recorded)),
        "extra": len(recorded) - len(set(recorded) & set(done)),
        "corrupt": corrupt,
        "production_is_top": bool(stack) and linked == stack[-1] == registry.production().version,
    }


def main() -> int:
    """Runs the races and prints one line each and the totals; exit 1 on any loss or mismatch."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--operations", type=int, default=100)
    parser.add_argument("--repetitions", type=int, default=20)
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--name", default="p0", help=argparse.SUPPRESS)
    parser.add_argument("--log", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--unlocked", action="store_true", help="without the registry lock (to see a race fail)")
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.name, args.operations, args.log, args.unlocked)
        return 0
    bad = 0
    started = time.perf_counter()
    for rep in range(args.repetitions):
        with tempfile.TemporaryDirectory(prefix="pruneops-race-") as tmp:
            tally = repetition(Path(tmp), args.processes, args.operations, args.unlocked)
        ok = tally["exit_codes"] == [0] * args.processes and tally["production_is_top"]
        ok = ok and tally["lost"] == tally["extra"] == tally["corrupt"] == 0
        bad += not ok
        print(json.dumps({"repetition": rep, **tally}), flush=True)
    print(
        f"{args.repetitions} repetitions x {args.processes} processes x {args.operations} operations "
        f"in {time.perf_counter() - started:.1f} s: {bad} with a loss, corruption or mismatch"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
