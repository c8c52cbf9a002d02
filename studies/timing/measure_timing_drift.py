"""How far the batch-1 time of two models, and its ratio, moves on this machine within minutes.

Usage: `python studies/timing/measure_timing_drift.py DENSE.onnx PRUNED.onnx [--passes 6] [--sessions 4]`

Each pass opens `--sessions` fresh ONNX Runtime sessions of each model (1 thread, as the benchmark)
and times them round-robin in one process (each timed call follows an untimed one, as the bench
does), then prints per pass the two medians, the spread of the per-session medians and the ratio
pruned / dense. Identical sessions that agree within a pass while the passes differ say the
machine drifted, not the sessions; a ratio that moves with it says the drift is not proportional,
so interleaving the two models does not cancel it (as on the ConvNeXt-style workload of
benchmarks/families.yaml, whose latency match once missed the other row by 17 %).
"""

import argparse
import time

import numpy as np

from pruneops.runtimes.onnxruntime.files import make_session


def time_pass(paths: dict[str, str], sessions: int, calls: int) -> dict[str, list[float]]:
    """Per model, the median ms of each of `sessions` fresh sessions, timed round-robin."""
    opened = {(name, i): make_session(path) for name, path in paths.items() for i in range(sessions)}
    feeds = {}
    for key, session in opened.items():
        spec = session.get_inputs()[0]
        shape = [1 if not isinstance(d, int) else d for d in spec.shape]
        feeds[key] = {spec.name: np.random.default_rng(0).standard_normal(shape).astype(np.float32)}
    for _ in range(20):  # warm-up
        for key, session in opened.items():
            session.run(None, feeds[key])
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in opened}
    for _ in range(calls):
        for key, session in opened.items():
            session.run(None, feeds[key])
            start = time.perf_counter()
            session.run(None, feeds[key])
            samples[key].append(time.perf_counter() - start)
    return {name: [1000 * float(np.median(samples[(name, i)])) for i in range(sessions)] for name in paths}


def main() -> None:
    """Prints, per pass, each model's median ms, the spread across its sessions and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dense")
    parser.add_argument("pruned")
    parser.add_argument("--passes", type=int, default=6)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    paths = {"dense": args.dense, "pruned": args.pruned}
    for number in range(1, args.passes + 1):
        medians = time_pass(paths, args.sessions, args.calls)
        dense, pruned = (float(np.median(medians[n])) for n in paths)
        spread = max(max(m) / min(m) for m in medians.values())
        print(
            f"pass {number} ({time.strftime('%H:%M:%S')}): dense {dense:.4f} ms, pruned {pruned:.4f} ms, "
            f"ratio {pruned / dense:.3f}; sessions within a pass agree to {spread:.3f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
