"""Where a stage's independent evaluations run (`pruneops.compute`): the same curves wherever they run.

- local: every call in order, with the shared objects;
- a Ray cluster on this machine (a head and one more node, one CPU each, on loopback) runs the
  sensitivity stage's sweep and gets the local stage's curves float for float (weights, MACs,
  warnings included; a gradient criterion too, whose gradients a pickled model would lose), and
  the sweep says where it ran;
- a worker killed while the sweep runs: Ray runs its task again and the curves are still the same;
- a task no node can take (more threads than any node's CPUs) is refused at once, not left waiting.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from pruneops.compute import LocalBackend
from pruneops.config import ComputeConfig
from pruneops.io import read_json
from pruneops.runner import run_stage
from tests.conftest import tiny_params, write_params

pytest.importorskip("ray", reason="the distributed extra (Ray) is not installed")


def test_local_backend_calls_every_job_in_order_with_the_shared_objects():
    calls = []

    def record(shared, a, b):
        calls.append((a, b))
        return shared["scale"] * a + b

    results = LocalBackend().map(record, [(1, 2), (3, 4), (5, 6)], ({"scale": 10},))
    assert results == [12, 34, 56]
    assert calls == [(1, 2), (3, 4), (5, 6)]
    assert ComputeConfig().backend == "local"
    with pytest.raises(ValueError, match="unknown compute backend 'dask'"):
        ComputeConfig(backend="dask")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_start(*args: str, log: Path, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats", *args]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _stop(process: subprocess.Popen) -> None:
    """`ray start --block` stops its raylet, object store and workers on SIGTERM."""
    if process.poll() is None:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)
    with contextlib.suppress(ProcessLookupError):  # anything of its session left behind
        os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster():
    """A Ray head and one more node on this machine, one CPU each; yields (address, environment, PIDs).

    The nodes and the stages that join them share a token of their own (Ray's token auth), given
    in the environment; the stages run as the CLI does under DVC, in a process of their own.
    """
    temp = Path(tempfile.mkdtemp(prefix="ray-"))  # short: Ray's socket paths must fit 107 bytes
    token = temp / "auth_token"
    token.write_text(secrets.token_hex(32))
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env.pop("RAY_AUTH_TOKEN", None)
    port = _free_port()
    # 127.0.0.2, not 127.0.0.1: Ray swaps 127.0.0.1 for the machine's address, and a multi-node
    # cluster refuses to form on loopback otherwise. (Its servers listen on every interface whatever
    # the node address; the token keeps others out.)
    address = f"127.0.0.2:{port}"
    common = ("--num-cpus=1", "--node-ip-address=127.0.0.2")
    head_args = ("--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={temp}", *common)
    nodes = [_ray_start(*head_args, log=temp / "head.log", env=env)]
    try:
        _wait_for(nodes[0], temp / "head.log", "Ray runtime started")
        nodes.append(_ray_start(f"--address={address}", *common, log=temp / "worker.log", env=env))
        _wait_for(nodes[1], temp / "worker.log", "Ray runtime started")
        yield address, env, [p.pid for p in nodes]
    finally:
        for process in reversed(nodes):
            _stop(process)
        shutil.rmtree(temp, ignore_errors=True)


def _wait_for(process: subprocess.Popen, log: Path, line: str, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while line not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
        time.sleep(0.5)


@pytest.fixture(scope="module")
def trained(pipeline_dir, tmp_path_factory):
    """The session's digits split and trained CNN, with the local sweep's output for each criterion."""
    root = tmp_path_factory.mktemp("compute")
    for stage in ("validate", "train"):
        shutil.copytree(pipeline_dir / "artifacts" / stage, root / "artifacts" / stage)
    return root


def _sweep(root: Path, importance: str, cluster: tuple | None = None, **compute) -> dict:
    """The sensitivity stage's sweep: here, or through the CLI on the cluster."""
    params = tiny_params(sensitivity={"ratios": [0.25, 0.5, 0.75], "importance": importance, "threads": 1})
    if cluster is None:
        run_stage("sensitivity", write_params(root, params), root)
    else:
        address, env, _ = cluster
        params["compute"] = {"backend": "ray", "address": address, **compute}
        cmd = [sys.executable, "-m", "pruneops.cli", "--params", str(write_params(root, params)), "--root", str(root)]
        done = subprocess.run([*cmd, "sensitivity"], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    return read_json(root / "artifacts/sensitivity/sensitivity.json")


def _same_curves(a: dict, b: dict) -> None:
    assert a["units"] == b["units"]
    assert a["weights"] == b["weights"]
    assert a["units"], "the sweep measured nothing"


@pytest.mark.parametrize("importance", ["l2", "taylor"])
def test_a_ray_cluster_sweeps_the_local_curves_exactly(trained, cluster, importance):
    local = _sweep(trained, importance)
    remote = _sweep(trained, importance, cluster)
    _same_curves(local, remote)
    assert local["computed_on"].startswith("local on ")
    assert remote["computed_on"] == f"ray at {cluster[0]}: 2 CPUs on 2 nodes"


def _descendants(pid: int) -> set[int]:
    """Every process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _kill_first_task(roots: list[int], killed: list[int], stop: threading.Event) -> None:
    """SIGKILLs the first Ray worker process of the cluster seen running a sweep task."""
    while not stop.is_set() and not killed:
        for pid in set().union(*(_descendants(r) for r in roots)):
            try:
                title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"ray::_run_task" in title:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
        time.sleep(0.01)


def test_a_worker_killed_mid_sweep_is_retried_and_the_curves_stay(trained, cluster):
    local = _sweep(trained, "l2")
    roots = cluster[2]
    killed: list[int] = []
    stop = threading.Event()
    watcher = threading.Thread(target=_kill_first_task, args=(roots, killed, stop), daemon=True)
    watcher.start()
    try:
        remote = _sweep(trained, "l2", cluster, max_retries=3)
    finally:
        stop.set()
        watcher.join()
    assert killed, "no sweep task was seen running to kill"
    _same_curves(local, remote)


def test_a_task_no_node_can_take_is_refused(trained, cluster):
    params = tiny_params(sensitivity={"ratios": [0.5], "threads": 2})
    params["compute"] = {"backend": "ray", "address": cluster[0]}
    cmd = [sys.executable, "-m", "pruneops.cli", "--params", str(write_params(trained, params)), "--root", str(trained)]
    done = subprocess.run([*cmd, "sensitivity"], env=cluster[1], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "no node of the Ray cluster has {'CPU': 2.0}" in done.stderr.strip().splitlines()[-1]
