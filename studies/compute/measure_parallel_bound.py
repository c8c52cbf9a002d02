"""What two cores allow: two one-thread processes running a model's forward at once against one alone.

    python studies/compute/measure_parallel_bound.py --model assets/all-minilm-l6-v2 --calls 30 --rounds 3

Each process loads the HuggingFace encoder, runs one warm-up forward of a batch of 32 sequences of
48 tokens, then `--calls` more; the aggregate throughput of two at once over one alone is the most a
two-worker sweep can gain over a one-worker sweep on this machine (shared caches and memory
bandwidth, the other core's interrupts). `studies/compute/measure_compute_scaling.py` measures the sweep.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time


def _forward_seconds(model_dir: str, calls: int, out: mp.Queue) -> None:
    import torch
    from transformers import AutoModel

    torch.set_num_threads(1)
    model = AutoModel.from_pretrained(model_dir).eval()
    ids = torch.randint(0, model.config.vocab_size, (32, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)
        started = time.perf_counter()
        for _ in range(calls):
            model(input_ids=ids)
    out.put(time.perf_counter() - started)


def _run(model_dir: str, calls: int, processes: int) -> list[float]:
    out: mp.Queue = mp.Queue()
    workers = [mp.Process(target=_forward_seconds, args=(model_dir, calls, out)) for _ in range(processes)]
    for worker in workers:
        worker.start()
    seconds = [out.get() for _ in workers]
    for worker in workers:
        worker.join()
    return seconds


def main() -> None:
    """Prints each round's times and the throughput of two processes over one."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="assets/all-minilm-l6-v2")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for round_ in range(args.rounds):
        (alone,) = _run(args.model, args.calls, 1)
        both = _run(args.model, args.calls, 2)
        print(
            f"round {round_ + 1}: alone {alone:.1f} s, two at once {both[0]:.1f} / {both[1]:.1f} s: "
            f"throughput x{2 * alone / max(both):.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
