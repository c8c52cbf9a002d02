"""An MLP-cut, recovered decoder with its output vocabulary cut too: perplexity and decode time.

The output projection over the vocabulary is the part of each generated token's work that no
layer or width cut removes. This measures what cutting it gives on top of the pipeline's MLP cut
(`pruneops.pruning.decoder_vocabulary`: `K` tokens keep their row, the rest share fitted tail
logits and the model's own prior, so every token keeps a probability):

- `dense`, and `mlp<m>`: the pipeline's MLP cut (activation importance, least-squares
  reconstruction) recovered as the bench file recovers its plans (distillation from dense, its
  learning rate and precision) within `--recover-tokens`;
- `mlp<m> vocab<K> tails<C>`: that recovered model with the vocabulary cut to each `K`, the
  dropped tokens scored through each `C` of `--tail-groups` (ranked on the training text, the model
  run on `--rank-blocks` of its blocks; no training).

`--mlp-width` at the model's own width and `--recover-tokens 0` measure the cut on the dense
model alone; `--save-recovered DIR` keeps the recovered model and `--recovered DIR` starts from it.

Every model is exported through onnxruntime-genai (INT8; fp32 too for dense and the MLP cut),
scored by its own logits on validation, test and out-of-domain blocks (each ratio paired against
the exported dense fp32), and timed interleaved in one process at the bench's prompt length,
tokens and threads. The deployed row is the fastest INT8 form whose *validation* perplexity lies
within the bench's budget; its test figures are the result. It prints JSON.

    python studies/decoder/measure_decoder_vocabulary.py --config studies/decoder-workload.yaml --mlp-width 704
    python studies/decoder/measure_decoder_vocabulary.py --keep 16384 24576 32768 --tail-groups 1 \
        --recover-tokens 300000
    python studies/decoder/measure_decoder_vocabulary.py --mlp-width 1536 --recover-tokens 0 --keep 16384 \
        --tail-groups 1 256
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # studies is not installed
from pruneops.models.decoders import load_causal_lm, save_causal_lm
from pruneops.models.language import paired_ratio_interval, perplexity_from_losses
from pruneops.planning.decode_cost import shape_of
from pruneops.pruning.decoder_cuts import calibrate, prune_to_shape_
from pruneops.pruning.decoder_vocabulary import vocabulary_cut_copy, vocabulary_evidence
from pruneops.runtimes.genai.export import export_model as export_genai
from pruneops.runtimes.genai.generation import exported_block_losses, time_generation
from pruneops.timing.machine import machine_info
from pruneops.training.recovery import recover_
from studies.workload import load_bench_config, recovery_settings, workload_data


def _recovered(dense, data, args, settings) -> tuple[torch.nn.Module, dict]:
    """The MLP cut, recovered within the token budget (or read back from `--recovered`)."""
    if args.recovered:
        return load_causal_lm(args.recovered)[0], {"recovered_from": str(args.recovered)}
    base = shape_of(dense.config)
    if args.mlp_width == base.mlp_width and not args.recover_tokens:
        return dense, {}
    narrow = copy.deepcopy(dense)
    calibration = calibrate(dense, data.calibration)
    prune_to_shape_(narrow, base.layers, args.mlp_width, base.kv_groups, base.queries_per_group, calibration)
    note = {}
    if args.recover_tokens:
        spent = recover_(narrow, dense, data.train, replace(settings, max_tokens=args.recover_tokens))
        note = {"recovery": {"tokens": spent.tokens, "wall_s": spent.wall_s, **asdict(settings)}}
    return narrow, note


def _models(dense, data, args, settings, tokenizer) -> tuple[dict, dict]:
    """Dense, the recovered MLP cut, and that cut with each vocabulary size and tail count; notes on each."""
    narrow, note = _recovered(dense, data, args, settings)
    if args.save_recovered:
        save_causal_lm(narrow, tokenizer, args.save_recovered)
    uncut = shape_of(narrow.config) == shape_of(dense.config) and not note
    name = "dense" if uncut else f"mlp{shape_of(narrow.config).mlp_width}"  # dense alone: no duplicate row
    models, notes = {"dense": dense, name: narrow}, {name: note}
    evidence = vocabulary_evidence(narrow, data.train, args.rank_blocks)
    for keep in args.keep:
        for groups in args.tail_groups:
            trimmed, cut = vocabulary_cut_copy(narrow, evidence, keep, groups)
            models[f"{name} vocab{keep} tails{groups}"] = trimmed
            notes[f"{name} vocab{keep} tails{groups}"] = {
                "tail_fit_rms_nats": cut.fit_rms,
                "test_tokens_kept": float(np.isin(data.test, cut.kept.numpy()).mean()),
                "ood_tokens_kept": float(np.isin(data.ood, cut.kept.numpy()).mean()) if data.ood is not None else None,
            }
    return models, notes


def _deployed(rows: dict, budget: float) -> str | None:
    """The fastest INT8 row whose validation perplexity ratio lies within the budget."""
    within = [n for n, r in rows.items() if n.endswith("int8") and r["val_ratio"][0] <= 1 + budget]
    return min(within, key=lambda n: rows[n]["tpot_ms"], default=None)


def main() -> None:
    """Cuts, recovers, cuts the vocabulary, exports, scores and times; prints the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("studies/decoder-workload.yaml"))
    parser.add_argument("--mlp-width", type=int, default=704)
    parser.add_argument("--keep", type=int, nargs="+", default=[16384, 24576, 32768])
    parser.add_argument("--recover-tokens", type=int, default=300000)
    parser.add_argument("--tail-groups", type=int, nargs="+", default=[256], help="tail logits of the dropped tokens")
    parser.add_argument(
        "--rank-blocks",
        type=int,
        default=96,
        help="training blocks the model runs on to rank and fit (the counts use all)",
    )
    parser.add_argument("--save-recovered", type=Path, help="keep the recovered MLP cut (a HuggingFace folder)")
    parser.add_argument("--recovered", type=Path, help="start from a recovered MLP cut saved before")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    config = load_bench_config(args.config)
    torch.set_num_threads(2)
    dense, tokenizer = load_causal_lm(config.model)
    data = workload_data(config, tokenizer)
    settings = recovery_settings(config)
    models, notes = _models(dense, data, args, settings, tokenizer)
    splits = {"val": data.val, "test": data.test, **({"ood": data.ood} if data.ood is not None else {})}
    with tempfile.TemporaryDirectory(prefix="pruneops-vocabulary-") as work:
        folders = {}
        for name, model in models.items():
            precisions = ["int8"] if "vocab" in name else ["fp32", "int8"]
            exported = export_genai(model, tokenizer, Path(work) / name.replace(" ", "_"), precisions, config.threads)
            folders.update({f"{name} {p}": path for p, path in exported.items()})
        prompt = np.random.default_rng(0).integers(0, dense.config.vocab_size, (1, config.prompt_length))
        timings = time_generation(folders, prompt, config.new_tokens, args.rounds)
        scores = {
            key: {s: perplexity_from_losses(exported_block_losses(folder, b), 0) for s, b in splits.items()}
            for key, folder in folders.items()
        }
    reference = scores["dense fp32"]
    rows = {}
    for key in folders:
        model_name = key.rsplit(" ", 1)[0]
        rows[key] = {
            **notes.get(model_name, {}),
            **{f"{s}_perplexity": scores[key][s].value for s in splits},
            **{f"{s}_ratio": list(paired_ratio_interval(scores[key][s], reference[s])) for s in splits},
            "tpot_ms": timings[key].tpot_ms,
            "ttft_ms": timings[key].ttft_ms,
            "speedup_vs_dense_fp32": timings["dense fp32"].tpot_ms / timings[key].tpot_ms,
        }
    for key, row in rows.items():
        ratio = ", ".join(
            f"{s} {row[f'{s}_ratio'][0]:.3f}x [{row[f'{s}_ratio'][1]:.3f}, {row[f'{s}_ratio'][2]:.3f}]" for s in splits
        )
        print(
            f"{key:28s} {row['tpot_ms']:6.2f} ms/token {row['speedup_vs_dense_fp32']:5.2f}x dense fp32  {ratio}",
            flush=True,
        )
    deployed = _deployed(rows, config.perplexity_budget)
    command = "python studies/decoder/measure_decoder_vocabulary.py " + " ".join(sys.argv[1:])
    result = {"command": command, "machine": machine_info(config.threads), "deployed": deployed, "rows": rows}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
