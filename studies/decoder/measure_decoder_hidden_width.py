"""A decoder's hidden width (embedding channels) cut, measured against MLP cuts; Llama layouts only.

The pruning units of the pipeline (MLP neurons, KV groups, layers) leave the hidden width, and
with it the tied output projection over the vocabulary, untouched. This measures what cutting it
would give: for each hidden width asked, the perplexity and the decode time of

- `hidden<w>`: the residual stream cut to `w` channels, ranked by the mean magnitude of every
  RMSNorm's output (Minitron's embedding-channel importance), each RMSNorm rescaled by the
  calibration energy the removed channels held (the norm then divides by the full stream's RMS,
  as before the cut); every projection that reads or writes the stream, the embedding and the
  tied output projection sliced to the kept channels;
- `mlp<m>`: the pipeline's own MLP cut (activation importance, least-squares reconstruction) to
  the width `m` that reads as many weights per token as `hidden<w>`;

and dense: validation and test perplexity with the paired 95 % interval of each ratio to dense's,
and each exported through onnxruntime-genai (fp32 and INT8) and timed interleaved in one process
at the bench's prompt length, tokens and threads. `--mlp-widths` names the MLP cuts instead (e.g. the one
that decodes as fast as a hidden cut); `--combined H:M` adds a cut of both, the MLP to `M` first,
then the hidden width to `H` (channels ranked on the MLP-cut model). `--recover-tokens` then recovers
every cut as the bench file recovers its plans (distillation from dense, its learning rate and
precision), within that many tokens, and scores it again. Every exported form (fp32, INT8) is also
scored by its own logits, as the bench scores what it deploys: test perplexity paired against the
exported dense fp32's. It prints JSON.

    python studies/decoder/measure_decoder_hidden_width.py --config studies/decoder-workload.yaml --widths 504 432
    python studies/decoder/measure_decoder_hidden_width.py --widths --mlp-widths 704 --combined 504:704 \
        --recover-tokens 300000
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
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # studies is not installed
from pruneops.models.decoder_layout import layout_of
from pruneops.models.decoders import keep_inputs_, keep_outputs_, load_causal_lm
from pruneops.models.language import paired_ratio_interval, perplexity, perplexity_from_losses
from pruneops.planning.decode_cost import shape_of, width_step
from pruneops.pruning.decoder_cuts import calibrate, prune_to_shape_, rebuild
from pruneops.runtimes.genai.export import export_model as export_genai
from pruneops.runtimes.genai.generation import exported_block_losses, time_generation
from pruneops.timing.machine import machine_info
from pruneops.training.recovery import recover_
from studies.workload import load_bench_config, recovery_settings, workload_data


def _norms(model: nn.Module) -> list[nn.Module]:
    """Every RMSNorm that reads the residual stream: two per layer, then the final one."""
    norms = [m for layer in model.model.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    return [*norms, model.model.norm]


def channel_statistics(model: nn.Module, blocks: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per channel: the summed mean |norm output| over every norm, and each norm's mean squared input."""
    norms = _norms(model)
    hidden = model.config.hidden_size
    magnitude = [torch.zeros(hidden, dtype=torch.float64) for _ in norms]
    energy = [torch.zeros(hidden, dtype=torch.float64) for _ in norms]
    count = [0]

    def hook(index: int):
        def gather(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            x, y = args[0].reshape(-1, hidden).double(), output.reshape(-1, hidden).double()
            magnitude[index] += y.abs().sum(0)
            energy[index] += (x * x).sum(0)
            if index == 0:
                count[0] += x.shape[0]

        return gather

    handles = [n.register_forward_hook(hook(i)) for i, n in enumerate(norms)]
    try:
        with torch.inference_mode():
            for start in range(0, len(blocks), 4):
                model(input_ids=blocks[start : start + 4], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return sum(m / count[0] for m in magnitude), [e / count[0] for e in energy]


def cut_hidden_(model: nn.Module, width: int, importance: torch.Tensor, energy: list[torch.Tensor]) -> None:
    """Keeps the `width` most important residual-stream channels of a Llama-layout model, in place."""
    hidden = model.config.hidden_size
    keep = torch.sort(torch.topk(importance, width).indices).values
    for norm, e in zip(_norms(model), energy, strict=True):
        rescale = float(torch.sqrt(hidden / width * e[keep].sum() / e.sum()))
        norm.weight = nn.Parameter(norm.weight.data[keep] * rescale)
    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for projection in (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj):
            keep_inputs_(projection, keep)
        for projection in (attention.o_proj, mlp.down_proj):
            keep_outputs_(projection, keep)
    embedding = model.model.embed_tokens
    embedding.weight = nn.Parameter(embedding.weight.data[:, keep].contiguous())
    embedding.embedding_dim = width
    if model.config.tie_word_embeddings:
        model.lm_head.weight = embedding.weight
    else:
        keep_inputs_(model.lm_head, keep)
    model.config.head_dim = model.config.head_dim or hidden // model.config.num_attention_heads
    model.config.hidden_size = width


def matching_mlp_width(model: nn.Module, width: int) -> int:
    """The MLP width whose per-token weights (layers and output projection) equal a hidden cut to `width`."""
    shape = shape_of(model.config)
    dense = shape.layer_weights + shape.output_weights
    scaled = dense * width / shape.hidden  # every weight that reads or writes the stream scales with it
    per_neuron = shape.layers * shape.mlp_projections * shape.hidden
    step = width_step(shape.mlp_width)
    return int(round((shape.mlp_width - (dense - scaled) / per_neuron) / step) * step)


def _score(model: nn.Module, data, dense: dict | None) -> dict:
    """Validation and test perplexity, each with its paired 95 % ratio against dense (same blocks)."""
    shape = shape_of(model.config)
    weights = shape.layer_weights + shape.output_weights
    row = {"shape": f"hidden {shape.hidden}, MLP {shape.mlp_width}", "weights_per_token": weights}
    for split, blocks in (("val", data.val), ("test", data.test)):
        score = perplexity(model, blocks)
        row[f"{split}_perplexity"] = [score.value, score.low, score.high]
        row[f"_{split}"] = score
        if dense is not None:
            row[f"{split}_perplexity_ratio"] = list(paired_ratio_interval(score, dense[f"_{split}"]))
    return row


def _print(results: dict) -> None:
    for name, row in results.items():
        ratios = {k: [round(x, 3) for x in v] for k, v in row.items() if k.endswith("perplexity_ratio")}
        print(name, row["shape"], ratios, flush=True)


def _cuts(
    dense: nn.Module, data, widths: list[int], mlp_widths: list[int] | None, combined: list[tuple[int, int]]
) -> dict[str, nn.Module]:
    """Dense and every cut asked for, by name: hidden widths, MLP widths, then both together."""
    importance, energy = channel_statistics(dense, data.calibration)
    calibration = calibrate(dense, data.calibration)
    base = shape_of(dense.config)
    models = {"dense": dense}
    for width in widths:
        hidden = copy.deepcopy(dense)
        cut_hidden_(hidden, width, importance, energy)
        models[f"hidden{width}"] = rebuild(hidden)  # the config expresses it: strict reload
    for mlp in mlp_widths if mlp_widths is not None else [matching_mlp_width(dense, w) for w in widths]:
        narrow = copy.deepcopy(dense)
        prune_to_shape_(narrow, base.layers, mlp, base.kv_groups, base.queries_per_group, calibration)
        models[f"mlp{mlp}"] = narrow
    for hidden, mlp in combined:
        both = copy.deepcopy(dense)
        prune_to_shape_(both, base.layers, mlp, base.kv_groups, base.queries_per_group, calibration)
        cut_hidden_(both, hidden, *channel_statistics(both, data.calibration))
        models[f"hidden{hidden}_mlp{mlp}"] = rebuild(both)
    return models


def main() -> None:
    """Cuts, scores and times each width against dense; prints the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("studies/decoder-workload.yaml"))
    parser.add_argument("--widths", type=int, nargs="*", default=[504, 432])
    parser.add_argument(
        "--mlp-widths", type=int, nargs="*", help="MLP cuts to compare (default: each hidden cut's weight match)"
    )
    parser.add_argument(
        "--combined", nargs="*", default=[], metavar="H:M", help="cuts of both: hidden width H, MLP width M"
    )
    parser.add_argument(
        "--recover-tokens", type=int, default=0, help="then recover every cut as the bench file does, this many tokens"
    )
    args = parser.parse_args()
    config = load_bench_config(args.config)
    torch.set_num_threads(2)
    dense, tokenizer = load_causal_lm(config.model)
    if layout_of(dense).name != "llama":
        raise SystemExit(f"measure_decoder_hidden_width: Llama layouts only, not {layout_of(dense).name}")
    heads = dense.config.num_attention_heads
    combined = [tuple(int(x) for x in c.split(":")) for c in args.combined]
    if bad := [w for w in [*args.widths, *(h for h, _ in combined)] if w % heads or w > dense.config.hidden_size]:
        # transformers refuses to save a config whose hidden size its head count does not divide.
        raise SystemExit(
            f"measure_decoder_hidden_width: widths {bad}: each a multiple of {heads} (the heads), at most "
            f"{dense.config.hidden_size}"
        )
    data = workload_data(config, tokenizer)
    models = _cuts(dense, data, args.widths, args.mlp_widths, combined)
    results = {"dense": _score(dense, data, None)}
    results.update({name: _score(m, data, results["dense"]) for name, m in models.items() if name != "dense"})
    _print(results)
    if args.recover_tokens:
        settings = replace(recovery_settings(config), max_tokens=args.recover_tokens)
        for name, model in models.items():
            if name != "dense":
                spent = recover_(model, dense, data.train, settings)
                cut = {k: v for k, v in results[name].items() if k.endswith("perplexity_ratio")}
                results[name] = {**_score(model, data, results["dense"]), "cut_only": cut}
                results[name]["recovery"] = {"tokens": spent.tokens, "wall_s": spent.wall_s, **asdict(settings)}
        _print(results)
    precisions = ["fp32", "int8"]
    with tempfile.TemporaryDirectory(prefix="pruneops-hidden-") as work:
        folders = {
            f"{n} {p}": path
            for n, m in models.items()
            for p, path in export_genai(m, tokenizer, Path(work) / n, precisions, config.threads).items()
        }
        prompt = np.random.default_rng(0).integers(0, dense.config.vocab_size, (1, config.prompt_length))
        timings = time_generation(folders, prompt, config.new_tokens, config.rounds)
        exported = {
            key: perplexity_from_losses(exported_block_losses(folder, data.test), 0) for key, folder in folders.items()
        }
    for name in models:
        for precision in precisions:
            timing = timings[f"{name} {precision}"]
            results[name][f"exported_test_perplexity_ratio_{precision}"] = list(
                paired_ratio_interval(exported[f"{name} {precision}"], exported["dense fp32"])
            )
            results[name][f"tpot_ms_{precision}"] = timing.tpot_ms
            results[name][f"speedup_{precision}_vs_dense_fp32"] = timings["dense fp32"].tpot_ms / timing.tpot_ms
    command = "python studies/decoder/measure_decoder_hidden_width.py " + " ".join(sys.argv[1:])
    rows = {n: {k: v for k, v in r.items() if not k.startswith("_")} for n, r in results.items()}
    print(json.dumps({"command": command, "machine": machine_info(config.threads), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
