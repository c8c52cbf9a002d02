"""Where independent evaluations run: one after another in this process, or as Ray tasks on a cluster.

A stage hands a backend a function, the objects every call shares (the trained model, the
validation split) and one argument tuple per call; the backend returns the results in the order
of the calls, whichever worker ran each. `local` runs them here; `ray` sends the shared objects to
the cluster's object store once and each call as a task that takes as many CPUs as the stage's
`threads` and runs torch on that many threads, so that every float is what a local run at those
threads computes (a reduction's order follows the thread count). A task whose worker dies runs
again, up to `compute.max_retries` times. Timing never goes through a backend: the
latency table, gates and benchmark are measured by the stage process, on the machine that serves.
"""

from __future__ import annotations

import copy
import logging
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tqdm.auto import tqdm

from pruneops.config import ComputeConfig
from pruneops.core.errors import ConfigError
from pruneops.core.plugins import Registry

T = TypeVar("T")

logger = logging.getLogger(__name__)


class Backend(Protocol):
    """Runs `fn(*shared, *job)` for every job and returns the results in job order."""

    def map(self, fn: Callable[..., T], jobs: Sequence[tuple], shared: tuple = (), desc: str = "") -> list[T]:
        """Calls `fn(*shared, *job)` for each job; `fn` must not change the shared objects."""
        ...

    def describe(self) -> str:
        """Where the calls run, for a report (`local on host`, `ray at address: N CPUs`)."""
        ...


@dataclass(frozen=True)
class LocalBackend:
    """Every call in this process, one after another (a progress bar counts them)."""

    def map(self, fn: Callable[..., T], jobs: Sequence[tuple], shared: tuple = (), desc: str = "") -> list[T]:
        """Calls `fn(*shared, *job)` for each job, in order."""
        return [fn(*shared, *job) for job in tqdm(jobs, desc=desc, unit="task", disable=None, leave=False)]

    def describe(self) -> str:
        """`local on <host>`."""
        return f"local on {socket.gethostname()}"


# The shared objects a Ray worker process has fetched, by object id: its later tasks reuse them
# instead of deserialising the model again. Only the latest map's objects are kept.
_FETCHED: dict[str, Any] = {}


def _run_task(fn: Callable[..., T], boxed: list[list[Any]], job: tuple, threads: int) -> T:
    """One job in a Ray worker: the shared objects (fetched once per process), then `fn`."""
    import ray
    import torch  # here, not at the top: the CLI imports this module, and serving has no torch

    torch.set_num_threads(threads)
    keys = [box[0].hex() for box in boxed]
    if set(keys) != set(_FETCHED):
        _FETCHED.clear()
        # A copy: the object store's arrays are read-only, and torch warns on each one it wraps.
        _FETCHED.update({k: copy.deepcopy(ray.get(box[0])) for k, box in zip(keys, boxed, strict=True)})
    return fn(*(_FETCHED[k] for k in keys), *job)


@dataclass(frozen=True)
class RayBackend:
    """Each call a Ray task on the cluster `ray.init` joined (see `open_backend`), on `threads` CPUs."""

    config: ComputeConfig
    threads: int = 1

    def map(self, fn: Callable[..., T], jobs: Sequence[tuple], shared: tuple = (), desc: str = "") -> list[T]:
        """Calls `fn(*shared, *job)` for each job as a Ray task; results in job order.

        The shared objects go to the object store once. Each one is passed inside a list, so that
        Ray hands the task its reference rather than a fresh copy, and the worker deserialises it
        on its first task only.

        Raises:
            RuntimeError: A task failed after its retries (its error, and which job it was).
        """
        import ray

        self._check_feasible(ray)
        boxed = [[ray.put(obj)] for obj in shared]
        task = ray.remote(
            num_cpus=self.threads,
            resources=dict(self.config.resources) or None,
            max_retries=self.config.max_retries,
        )(_run_task)
        futures = [task.remote(fn, boxed, job, self.threads) for job in jobs]
        pending = list(futures)
        with tqdm(total=len(futures), desc=desc, unit="task", disable=None, leave=False) as bar:
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                bar.update(len(done))
        results = []
        for job, future in zip(jobs, futures, strict=True):
            try:
                results.append(ray.get(future))
            except ray.exceptions.RayError as exc:
                raise RuntimeError(f"{desc or 'task'} {job!r} failed on the Ray cluster: {exc}") from exc
        return results

    def _check_feasible(self, ray: Any) -> None:
        """Refuses tasks no node can take (Ray would wait for such a node forever).

        Raises:
            ConfigError: No alive node has `threads` CPUs and the `compute.resources` labels.
        """
        wanted = {"CPU": float(self.threads), **self.config.resources}
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        if any(all(node.get(k, 0) >= v for k, v in wanted.items()) for node in nodes):
            return
        largest = max((node.get("CPU", 0) for node in nodes), default=0)
        raise ConfigError(
            f"compute: no node of the Ray cluster has {wanted} for one evaluation (the stage's threads and "
            f"compute.resources; the largest node has {largest:g} CPUs): lower the stage's threads or add such a node"
        )

    def describe(self) -> str:
        """`ray at <address>: N CPUs on M nodes`."""
        import ray

        nodes = [n for n in ray.nodes() if n.get("Alive")]
        cpus = sum(n.get("Resources", {}).get("CPU", 0) for n in nodes)
        where = self.config.address or "a local instance"
        return f"ray at {where}: {cpus:g} CPUs on {len(nodes)} node{'s' * (len(nodes) != 1)}"


# name -> make(config, threads per evaluation)
BACKENDS: Registry[Callable[[ComputeConfig, int], Any]] = Registry("compute backend")

BACKENDS.register("local", "every evaluation in the stage's process, one after another")(
    lambda config, threads: LocalBackend()
)
BACKENDS.register("ray", "each evaluation a Ray task on the cluster at compute.address (or a local instance)")(
    RayBackend
)


@contextmanager
def open_backend(config: ComputeConfig | None, project: Path | None = None, threads: int = 1) -> Iterator[Backend]:
    """The configured backend, connected for the duration of the block.

    `threads` is what each evaluation runs on (the stage's `threads`): a Ray task reserves as
    many CPUs. The local backend runs on the threads torch is set to.

    For `ray`, joins the cluster at `compute.address` (or starts an instance on this machine with
    `compute.local_cpus` CPUs) unless this process has already joined one, and leaves it after.
    `project` goes on the workers' `PYTHONPATH`, where a user's model module lives.

    Raises:
        ConfigError: `ray` without Ray installed, or a cluster that cannot be reached.
    """
    config = config or ComputeConfig()
    make = BACKENDS.get(config.backend)
    if config.backend != "ray":
        yield make(config, threads)
        return
    try:
        import ray
    except ImportError:
        raise ConfigError("compute.backend: ray needs Ray installed: pip install 'pruneops[distributed]'") from None
    joined = not ray.is_initialized()
    if joined:
        _join(ray, config, project)
    try:
        backend = make(config, threads)
        logger.info("compute: %s", backend.describe())
        yield backend
    finally:
        if joined:
            ray.shutdown()


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Refuses an address nothing listens on (Ray would retry it for minutes).

    Raises:
        ConfigError: Not `host:port`, or no answer within `timeout_s`.
    """
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"compute.address: expected host:port of the Ray head, got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ConfigError(
            f"compute.address: nothing answers at {address} ({exc.strerror or exc}); start the cluster "
            "(`ray start --head`, `make ray-local`) or set compute.backend: local"
        ) from None


def _join(ray: Any, config: ComputeConfig, project: Path | None) -> None:
    """`ray.init` for `config`: the cluster at its address, else a new instance here."""
    paths = [str(Path(project).resolve())] if project is not None else []
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(paths)}} if paths else None
    options: dict[str, Any] = {"runtime_env": runtime_env, "logging_level": logging.WARNING}
    if config.address is None:
        options |= {"num_cpus": config.local_cpus, "include_dashboard": False}
    else:
        _check_reachable(config.address)
    try:
        ray.init(address=config.address, **options)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"compute.address: cannot join the Ray cluster at {config.address}: {exc}") from None


def run_on_timing_node(run: Callable[[], T], config: ComputeConfig, project: Path) -> T:
    """Runs `run` (a timed stage) as one Ray task on the node labelled `compute.timing_resource`.

    The task holds every CPU of that node, so nothing else the cluster runs shares its cores while
    it times. The node must see the project at the same path (a shared volume).

    Raises:
        ConfigError: No alive node has the resource.
    """
    with open_backend(config, project):
        import ray

        label = config.timing_resource
        nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(label, 0) >= 1]
        if not nodes:
            raise ConfigError(
                f"compute.timing_resource: no node of the Ray cluster has the resource {label!r}; start the serving "
                f"machine's node with `ray start --resources='{{\"{label}\": 1}}'`"
            )
        cpus = max(n["Resources"].get("CPU", 0) for n in nodes)
        task = ray.remote(num_cpus=cpus, resources={label: 1}, max_retries=0)(_run_timed)
        result, node, host = ray.get(task.remote(run))
        logger.info("timed on the node with %s: %s (%s)", label, node, host)
        return result


def _run_timed(run: Callable[[], T]) -> tuple[T, str, str]:
    """`run()` in a Ray task: its result, the node it ran on, the host."""
    import ray

    return run(), ray.get_runtime_context().get_node_id(), socket.gethostname()
