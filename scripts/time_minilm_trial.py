"""Estimates what one plan trial (`prune.trials.count`) costs on MiniLM-L6 on this machine.

A trial trains one pass over `prune.trials.samples` (3,200) training samples and scores the
validation set. This times the dense encoder's training step (batch 32, AdamW) and its forward
pass per sample at two token lengths, and scales them: an upper bound per plan, since a
shortlisted plan is pruned (fewer heads and FFN channels run faster). Needs `make text-assets`.

Usage:
    python scripts/time_minilm_trial.py [--model state/assets/all-minilm-l6-v2] [--val 1275]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForSequenceClassification


def main() -> int:
    """Prints the estimated seconds of one dense trial per token length."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="state/assets/all-minilm-l6-v2")
    parser.add_argument("--val", type=int, default=1275, help="validation samples per trial (text workload ~1,275)")
    parser.add_argument("--samples", type=int, default=3200, help="prune.trials.samples")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    for length in (48, 64):
        x, y = torch.randint(1000, 20000, (32, length)), torch.randint(0, 2, (32,))
        model.train()
        timed = []
        for step in range(10):
            started = time.perf_counter()
            model(input_ids=x, attention_mask=torch.ones_like(x), labels=y).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if step >= 2:  # the first steps allocate
                timed.append(time.perf_counter() - started)
        step_s = sorted(timed)[len(timed) // 2]
        model.eval()
        batch = torch.randint(1000, 20000, (256, length))
        with torch.no_grad():
            started = time.perf_counter()
            model(input_ids=batch, attention_mask=torch.ones_like(batch))
            per_sample = (time.perf_counter() - started) / len(batch)
        train_s = args.samples / 32 * step_s
        print(
            f"{length} tokens: train step {step_s:.3f} s (batch 32) -> {train_s:.0f} s for {args.samples} samples; "
            f"validation {args.val * per_sample:.1f} s; one dense trial ~{train_s + args.val * per_sample:.0f} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
