"""A Ray cluster of several nodes on this machine: for trying `compute.backend: ray`, its tests and benchmark.

Each node is a `ray start --block` process with its own CPUs, so that "two one-CPU workers" means
two nodes of one CPU each, as on two machines. The nodes share a token of their own (Ray's token
authentication); a process that joins them needs the environment this module yields. Ray's
servers listen on every interface whatever the node address: the token keeps others out.
"""

from __future__ import annotations

import contextlib
import json
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Ray swaps 127.0.0.1 for the machine's address, and on loopback it refuses a multi-node cluster;
# another loopback address keeps the nodes on this machine.
NODE_ADDRESS = "127.0.0.2"

STARTED = "Ray runtime started"


@dataclass(frozen=True)
class LocalCluster:
    """A running local cluster: its address, the environment that joins it, its node processes."""

    address: str
    env: dict[str, str]
    pids: tuple[int, ...]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: tuple[str, ...], log: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats", *args]
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, env=env)


def _wait_started(process: subprocess.Popen, log: Path, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while STARTED not in log.read_text():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"a Ray node did not start ({log}):\n{log.read_text()[-2000:]}")
        time.sleep(0.25)


def _stop(process: subprocess.Popen) -> None:
    """`ray start --block` stops its raylet, object store and workers on SIGTERM; then its session goes."""
    if process.poll() is None:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


@contextlib.contextmanager
def local_cluster(
    nodes: int = 2, cpus: int = 1, start_timeout_s: float = 60.0, resources: dict[int, dict[str, float]] | None = None
) -> Iterator[LocalCluster]:
    """Starts `nodes` Ray nodes of `cpus` CPUs each here (the first the head); stops them by PID after.

    `resources` gives nodes (by index) custom Ray resources, e.g. `{1: {"serving": 1}}`.

    Raises:
        RuntimeError: A node did not start within `start_timeout_s` (its log's tail).
    """
    temp = Path(tempfile.mkdtemp(prefix="ray-"))  # short: Ray's socket paths must fit in 107 bytes
    token = temp / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    env.pop("RAY_AUTH_TOKEN", None)
    port = _free_port()
    address = f"{NODE_ADDRESS}:{port}"
    common = (f"--num-cpus={cpus}", f"--node-ip-address={NODE_ADDRESS}")
    head = ("--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={temp}", *common)
    started: list[subprocess.Popen] = []
    try:
        for i in range(nodes):
            log = temp / f"node{i}.log"
            labels = (f"--resources={json.dumps(resources[i])}",) if resources and i in resources else ()
            started.append(_start((*(head if i == 0 else (f"--address={address}", *common)), *labels), log, env))
            _wait_started(started[-1], log, start_timeout_s)
        yield LocalCluster(address, env, tuple(p.pid for p in started))
    finally:
        for process in reversed(started):
            _stop(process)
        shutil.rmtree(temp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m pruneops.pipeline.ray_cluster --nodes 2`: a local cluster until Ctrl-C, and how to join it."""
    import argparse

    parser = argparse.ArgumentParser(description="A Ray cluster of several nodes on this machine, until Ctrl-C")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--cpus", type=int, default=1, help="CPUs of each node")
    args = parser.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with local_cluster(args.nodes, args.cpus) as cluster:
        print(
            f"Ray cluster: {args.nodes} nodes of {args.cpus} CPU(s) at {cluster.address}. In another shell:\n"
            f"  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={cluster.env['RAY_AUTH_TOKEN_PATH']}\n"
            f"  then set `compute: {{backend: ray, address: {cluster.address}}}` in params.yaml "
            f'(or PRUNEOPS_SET="compute.backend=ray compute.address={cluster.address}")\n'
            "Ctrl-C stops it.",
            flush=True,
        )
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
