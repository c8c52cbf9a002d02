"""Where a stage's independent evaluations run (`pruneops.pipeline.compute`): the same curves wherever they run.

- local: every call in order, with the shared objects;
- a Ray cluster on this machine (a head and one more node, one CPU each, on loopback) runs the
  sensitivity stage's sweep and gets the local stage's curves float for float (weights, MACs,
  warnings included; a gradient criterion too, whose gradients a pickled model would lose), and
  the sweep says where it ran;
- a worker killed while the sweep runs: Ray runs its task again and the curves are still the same;
- a task no node can take (more threads than any node's CPUs) is refused at once, not left waiting;
- with `compute.timing_resource`, a timed stage (the benchmark) runs whole on the node so labelled,
  and a label no node has is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pruneops.config import ComputeConfig
from pruneops.core.io import read_json
from pruneops.pipeline.compute import LocalBackend
from pruneops.pipeline.ray_cluster import LocalCluster, local_cluster
from pruneops.pipeline.runner import run_stage
from tests.conftest import tiny_params, write_params

pytest.importorskip("ray", reason="the distributed extra (Ray) is not installed")


def test_an_address_nothing_answers_at_is_refused_at_once(tmp_path):
    from pruneops.core.errors import ConfigError
    from pruneops.pipeline.compute import open_backend

    started = time.monotonic()
    with (
        pytest.raises(ConfigError, match=r"nothing answers at 127.0.0.2:1 "),
        open_backend(ComputeConfig(backend="ray", address="127.0.0.2:1"), tmp_path),
    ):
        pass
    assert time.monotonic() - started < 10  # not Ray's minutes of retries
    with pytest.raises(ValueError, match="address"):
        ComputeConfig(backend="ray", address="head-without-port")


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


@pytest.fixture(scope="module")
def cluster():
    """A Ray head and one more node on this machine, one CPU each (`pruneops.pipeline.ray_cluster`); the second
    is labelled `serving` (the machine the timed stages run on)."""
    with local_cluster(nodes=2, cpus=1, resources={1: {"serving": 1}}) as running:
        yield running


@pytest.fixture(scope="module")
def trained(pipeline_dir, tmp_path_factory):
    """The session's digits split and trained CNN, with the local sweep's output for each criterion."""
    root = tmp_path_factory.mktemp("compute")
    for stage in ("validate", "train"):
        shutil.copytree(pipeline_dir / "artifacts" / stage, root / "artifacts" / stage)
    return root


def _sensitivity_cli(root: Path, params: dict, cluster: LocalCluster) -> subprocess.CompletedProcess:
    """`pruneops sensitivity` as DVC runs it, in the environment that joins the cluster."""
    cmd = [sys.executable, "-m", "pruneops.cli", "--params", str(write_params(root, params)), "--root", str(root)]
    return subprocess.run([*cmd, "sensitivity"], env=cluster.env, capture_output=True, text=True, timeout=300)


def _sweep(root: Path, importance: str, cluster: LocalCluster | None = None, **compute) -> dict:
    """The sensitivity stage's sweep: here, or through the CLI on the cluster."""
    params = tiny_params(sensitivity={"ratios": [0.25, 0.5, 0.75], "importance": importance, "threads": 1})
    if cluster is None:
        run_stage("sensitivity", write_params(root, params), root)
    else:
        params["compute"] = {"backend": "ray", "address": cluster.address, **compute}
        done = _sensitivity_cli(root, params, cluster)
        assert done.returncode == 0, done.stderr[-3000:]
    return read_json(root / "artifacts/sensitivity/sensitivity.json")


def _same_curves(a: dict, b: dict) -> None:
    assert a["units"] == b["units"]
    assert a["weights"] == b["weights"]
    assert a["units"], "the sweep measured nothing"


# `taylor` (gradients shipped beside the model) is in the slow group: `make test` keeps one sweep on
# the cluster and the refusal (the cluster's start, ~20 s, is paid once per session).
@pytest.mark.slow(reason="a local Ray cluster of two nodes: about 9 s to start and 3 s to stop on 2 cores")
@pytest.mark.parametrize("importance", ["l2", "taylor"])
def test_a_ray_cluster_sweeps_the_local_curves_exactly(trained, cluster, importance):
    local = _sweep(trained, importance)
    remote = _sweep(trained, importance, cluster)
    _same_curves(local, remote)
    assert local["computed_on"].startswith("local on ")
    assert remote["computed_on"] == f"ray at {cluster.address}: 2 CPUs on 2 nodes"


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


@pytest.mark.slow
def test_a_worker_killed_mid_sweep_is_retried_and_the_curves_stay(trained, cluster):
    local = _sweep(trained, "l2")
    roots = list(cluster.pids)
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


@pytest.mark.slow(reason="a local Ray cluster of two nodes (shared with the sweeps above)")
def test_a_task_no_node_can_take_is_refused(trained, cluster):
    params = tiny_params(sensitivity={"ratios": [0.5], "threads": 2})
    params["compute"] = {"backend": "ray", "address": cluster.address}
    done = _sensitivity_cli(trained, params, cluster)
    assert done.returncode == 2
    assert "no node of the Ray cluster has {'CPU': 2.0}" in done.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_decoders_layer_sweep_on_the_cluster_is_the_local_one(tmp_path, cluster):
    pytest.importorskip("transformers")
    from tests.decoder_helpers import decoder_params, save_tiny, speeches

    save_tiny("llama", tmp_path / "model")
    (tmp_path / "corpus.txt").write_text("\n\n".join(speeches(60)))
    params = decoder_params(tmp_path / "model", tmp_path / "corpus.txt", sensitivity={"threads": 1})
    path = write_params(tmp_path, params)
    for stage in ("validate", "train", "sensitivity"):
        run_stage(stage, path, tmp_path)
    local = read_json(tmp_path / "artifacts/sensitivity/layers.json")
    params["compute"] = {"backend": "ray", "address": cluster.address}
    done = _sensitivity_cli(tmp_path, params, cluster)
    assert done.returncode == 0, done.stderr[-3000:]
    remote = read_json(tmp_path / "artifacts/sensitivity/layers.json")
    assert remote == local
    assert len(local["layers"]) >= 2


# Plan trials of a shortlist, here and on the cluster, in a process that joins it (as the prune stage does).
PLAN_TRIALS = """
import sys
from pathlib import Path
import numpy as np
from pruneops.models.checkpoint import load_checkpoint
from pruneops.pipeline.compute import LocalBackend, open_backend
from pruneops.config import ComputeConfig, PruneConfig
from pruneops.data import load_prepared
from pruneops.core.inputs import head_tensors
from pruneops.planning.latency_allocation import PlanOption
from pruneops.planning.trials import PlanTrials
from pruneops.pruning.methods import METHODS
from pruneops.pruning.units import unit_sizes
from pruneops.task.classification.prune import make_context
import torch

torch.set_num_threads(1)
root = Path(sys.argv[1])
_, train, val, _ = load_prepared(root / "artifacts/validate")
model = load_checkpoint(root / "artifacts/train/model.safetensors").model
example = head_tensors(val.x)
config = PruneConfig(trials={"samples": 256}, threads=1)
sizes = unit_sizes(model, example)

def make_method(ratio, ratios):
    return METHODS.get(config.method)(make_context(config, train, example, ratio, ratios))

options = tuple(
    PlanOption({n: max(1, round(s * keep)) for n, s in sizes.items()}, dict.fromkeys(sizes, 1 - keep), keep, 0.0, False)
    for keep in (0.9, 0.6, 0.3)
)
results = {}
with open_backend(ComputeConfig(backend="ray", address=sys.argv[2]), root, 1) as ray_backend:
    for name, backend in (("local", LocalBackend()), ("ray", ray_backend)):
        trials = PlanTrials(config, model, make_method, example, train, val, backend)
        chosen = trials(options)
        results[name] = (chosen, [trials.correct(o) for o in options], [r["widths"] for r in trials.records])
same = results["local"][0] == results["ray"][0] and results["local"][2] == results["ray"][2]
same = same and all(np.array_equal(a, b) for a, b in zip(results["local"][1], results["ray"][1]))
print("IDENTICAL" if same else f"DIFFERENT {results}")
"""


@pytest.mark.slow
def test_plan_trials_train_on_the_cluster_to_the_local_results(trained, cluster):
    done = subprocess.run(
        [sys.executable, "-c", PLAN_TRIALS, str(trained), cluster.address],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "IDENTICAL"


# The cluster's nodes and their resources, from a process that joins it.
NODES = (
    "import json, ray, sys; ray.init(address=sys.argv[1]); "
    "print(json.dumps({n['NodeID']: n['Resources'] for n in ray.nodes()}))"
)


@pytest.mark.slow  # the session pipeline's benchmark stage, timed on the labelled node (~20 s)
def test_a_timed_stage_runs_whole_on_the_node_that_serves(pipeline_dir, tmp_path, cluster):
    shutil.copytree(pipeline_dir / "artifacts", tmp_path / "artifacts")
    params = tiny_params()

    def benchmark(timing_resource: str) -> subprocess.CompletedProcess:
        params["compute"] = {"backend": "ray", "address": cluster.address, "timing_resource": timing_resource}
        cmd = [sys.executable, "-m", "pruneops.cli", "--params", str(write_params(tmp_path, params))]
        cmd += ["--root", str(tmp_path), "benchmark"]
        return subprocess.run(cmd, env=cluster.env, capture_output=True, text=True, timeout=300)

    done = benchmark("serving")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "metrics/benchmark.json").is_file()
    timed_on = next(line for line in done.stderr.splitlines() if "timed on the node with serving:" in line)
    nodes = subprocess.run([sys.executable, "-c", NODES, cluster.address], env=cluster.env, capture_output=True)
    resources = json.loads(nodes.stdout.decode().strip().splitlines()[-1])
    serving = [node for node, res in resources.items() if res.get("serving")]
    assert len(serving) == 1 and serving[0] in timed_on

    done = benchmark("gpu-box")  # no node has it: refused, nothing timed elsewhere
    assert done.returncode == 2 and "no node of the Ray cluster has the resource 'gpu-box'" in done.stderr
