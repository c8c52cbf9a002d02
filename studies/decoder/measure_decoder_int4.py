"""Weight-only INT4 variants of onnxruntime-genai's builder against fp32 and INT8, on a bench-decoder workload.

Usage: `python studies/decoder/measure_decoder_int4.py --config studies/decoder-workload.yaml`

Exports the workload's dense model in fp32, INT8 and INT4 with the builder's default and each of
its `algo_config`s (RTN; RTN with the output projection in INT8; k-quant; k-quant with the output
projection and the llama.cpp "mixed" layers in INT8), scores each by its own exported logits on the workload's
validation and test blocks (change against fp32, paired 95 % interval over blocks), and times all
of them interleaved (batch 1, the workload's prompt length, new tokens, rounds and threads).
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # studies is not installed
from pruneops.models.decoders import load_causal_lm, save_causal_lm
from pruneops.models.language import paired_ratio_interval, perplexity_from_losses
from pruneops.runtimes.genai.generation import exported_block_losses, time_generation
from studies.workload import load_bench_config, workload_data

VARIANTS = {  # name -> (builder precision, builder extra options)
    "fp32": ("fp32", []),
    "int8": ("int8", []),
    "int4": ("int4", []),  # the builder's default, what `int4` means in PruneOps
    "int4 rtn": ("int4", ["algo_config=rtn"]),
    "int4 rtn_last": ("int4", ["algo_config=rtn_last"]),
    "int4 k_quant": ("int4", ["algo_config=k_quant"]),
    "int4 k_quant_mixed": ("int4", ["algo_config=k_quant_mixed"]),
}


def _build(hf: Path, out: Path, precision: str, extra: list[str], threads: int) -> Path:
    command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out)]
    command += ["-p", precision, "-e", "cpu", *(["--extra_options", *extra] if extra else [])]
    subprocess.run(command, check=True, capture_output=True)
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    config["model"]["decoder"].setdefault("session_options", {}).update(
        intra_op_num_threads=threads, inter_op_num_threads=1
    )
    config_path.write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    """Prints each variant's size, perplexity change against fp32 and decode time."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a bench-decoder file")
    args = parser.parse_args()
    config = load_bench_config(Path(args.config)).model_copy(update={"zero_shot": None, "out_of_domain": None})
    dense, tokenizer = load_causal_lm(config.model)
    data = workload_data(config, tokenizer)
    with tempfile.TemporaryDirectory(prefix="pruneops-int4-") as work:
        hf = save_causal_lm(dense, tokenizer, Path(work) / "hf")
        folders = {
            name: _build(hf, Path(work) / name.replace(" ", "-"), precision, extra, config.threads)
            for name, (precision, extra) in VARIANTS.items()
        }
        losses = {
            name: {split: exported_block_losses(folder, getattr(data, split), threads=2) for split in ("val", "test")}
            for name, folder in folders.items()
        }
        prompt = np.random.default_rng(config.seed).integers(0, dense.config.vocab_size, (1, config.prompt_length))
        timed = time_generation(folders, prompt, config.new_tokens, config.rounds)
        sizes = {name: sum(p.stat().st_size for p in f.glob("model.onnx*")) / 2**20 for name, f in folders.items()}
    dense_tpot = timed["fp32"].tpot_ms
    print("| variant | size (MiB) | Δ val ppl | Δ test ppl [95% CI] | TPOT b1 (ms) | vs fp32 | TTFT b1 (ms) |")
    print("|---|---|---|---|---|---|---|")
    for name in folders:
        size = sizes[name]
        val = np.exp(losses[name]["val"].mean() - losses["fp32"]["val"].mean()) - 1
        ratio, low, high = paired_ratio_interval(
            perplexity_from_losses(losses[name]["test"], 0),
            perplexity_from_losses(losses["fp32"]["test"], 0),
            seed=config.seed,
        )
        print(
            f"| {name} | {size:.1f} | {100 * val:+.1f} % | {100 * (ratio - 1):+.1f} "
            f"[{100 * (low - 1):+.1f}, {100 * (high - 1):+.1f}] | {timed[name].tpot_ms:.2f} | "
            f"{dense_tpot / timed[name].tpot_ms:.2f}x | {timed[name].ttft_ms:.0f} |"
        )


if __name__ == "__main__":
    main()
