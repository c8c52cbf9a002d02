r"""A decoder workload on a CUDA device: decode latency of its shapes, and recovery on the GPU.

Two parts, on the workload of a bench-decoder file (its model, corpus split, prompt length,
generated tokens, batches and recovery settings):

1. **Latency on CUDA** (`--shapes`): dense and each shape `layers:mlp_width:kv_groups`, cut from
   the dense model as the bench cuts ours (activation importance, least-squares reconstruction;
   with `--random-weights`, cut from a dense model of random weights as the latency stage cuts its
   timing shapes: the timing of dense matrix products does not depend on the values). Each in
   fp32 and bf16, timed interleaved round by round in one process, at each batch: time to first
   token (prefill of the prompt and the first token) and time per output token (each further
   token with the KV cache), every step synchronised, so it is what a caller streaming tokens
   waits. Two ways to run the step: `eager` (transformers' forward with its dynamic cache, what
   `generate` does) and `graph` (the same forward with a static cache, captured once as a CUDA
   graph and replayed: no per-kernel launch cost). The graph's greedy tokens are checked against
   eager's.
2. **Recovery on the GPU** (`--recover shape:tokens[:distill_weight]`): the shape cut from the
   dense model, distilled from it on the workload's training blocks on the CUDA device with the
   bench file's recovery settings (its learning rate, batch, bf16 or fp32), within that many tokens;
   then validation, test and out-of-domain perplexity with the paired 95 % interval of each ratio
   to dense's, as the bench reports them, and the wall time and tokens per second.

Usage:
    python studies/gpu/measure_decoder_gpu.py --config studies/decoder-workload.yaml --out DIR \\
        [--model PATH] [--shapes 30:704:3 18:1536:3] [--recover 30:704:3:300000] [--random-weights]

Writes `DIR/gpu-decoder.json` and `DIR/gpu-decoder.md` and prints a summary; `--render A.json B.json
--out DIR` writes the markdown of saved reports again. Without a CUDA device it says so and runs on
the CPU with one round and few tokens (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pruneops.models.decoders import load_causal_lm  # noqa: E402
from pruneops.models.language import paired_ratio_interval, perplexity  # noqa: E402
from pruneops.planning.decode_cost import DecoderShape, shape_of  # noqa: E402
from pruneops.pruning.decoder_cuts import calibrate  # noqa: E402
from pruneops.task.causal_lm.common import cut_for_timing, cut_to_shape  # noqa: E402
from pruneops.training.recovery import recover_  # noqa: E402
from studies.workload import load_bench_config, recovery_settings, workload_data  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_shape(text: str, base: DecoderShape) -> DecoderShape:
    """`layers:mlp_width:kv_groups` as a shape of the dense model's family."""
    layers, mlp, groups = (int(x) for x in text.split(":")[:3])
    return replace(base, layers=layers, mlp_width=mlp, kv_groups=groups)


@dataclass
class Steps:
    """One generation: its greedy tokens, time to first token and each further token's time (s)."""

    tokens: torch.Tensor
    ttft_s: float
    tpot_s: list[float]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _next(logits: torch.Tensor) -> torch.Tensor:
    return logits[:, -1].argmax(-1, keepdim=True)


@torch.inference_mode()
def generate_eager(model: nn.Module, prompt: torch.Tensor, new_tokens: int) -> Steps:
    """Greedy generation with transformers' dynamic cache, every step synchronised and timed."""
    from transformers import DynamicCache

    device = prompt.device
    cache = DynamicCache(config=model.config)
    started = time.perf_counter()
    token = _next(model(input_ids=prompt, past_key_values=cache, use_cache=True).logits)
    _sync(device)
    ttft = time.perf_counter() - started
    tokens, times = [token], []
    for _ in range(new_tokens - 1):
        started = time.perf_counter()
        token = _next(model(input_ids=token, past_key_values=cache, use_cache=True).logits)
        _sync(device)
        times.append(time.perf_counter() - started)
        tokens.append(token)
    return Steps(torch.cat(tokens, 1).cpu(), ttft, times)


class GraphDecoder:
    """The decode step of one model at one batch, on a static cache, captured once as a CUDA graph.

    Off CUDA the same static-cache step runs eagerly, warm-ups included (a check of the code path,
    not of graphs).
    """

    def __init__(self, model: nn.Module, batch: int, prompt_length: int, new_tokens: int, device: torch.device):
        from transformers import StaticCache

        self.model, self.prompt_length, self.device = model, prompt_length, device
        self.cache = StaticCache(config=model.config, max_cache_len=prompt_length + new_tokens)
        self.ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.prepared = False

    def _step(self) -> torch.Tensor:
        return self.model(
            input_ids=self.ids, past_key_values=self.cache, cache_position=self.position, use_cache=True
        ).logits

    def _rewind(self, length: int) -> None:
        """Sets the static cache's own write position to `length`.

        transformers' static layers count the tokens they hold in a tensor that every step advances
        in place (warm-ups and graph replays included), and write the next keys there.
        """
        for layer in self.cache.layers:
            counter = getattr(layer, "cumulative_length", None)
            if isinstance(counter, torch.Tensor):
                counter.fill_(length)

    def _prepare(self) -> None:
        """Two warm-up steps (off the default stream on CUDA, as capture requires), then the capture."""
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None
        if cuda:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for _ in range(2):
                self._step()
        if cuda:
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._step()
        self._rewind(self.prompt_length)  # the warm-ups wrote the first step's keys: it writes them again
        self.prepared = True

    @torch.inference_mode()
    def generate(self, prompt: torch.Tensor, new_tokens: int) -> Steps:
        """Greedy generation: eager prefill into the static cache, then the captured step replayed."""
        self.cache.reset()
        started = time.perf_counter()
        position = torch.arange(self.prompt_length, device=self.device)
        out = self.model(input_ids=prompt, past_key_values=self.cache, cache_position=position, use_cache=True)
        token = _next(out.logits)
        _sync(self.device)
        ttft = time.perf_counter() - started
        if not self.prepared:
            self.ids.copy_(token)
            self.position.fill_(self.prompt_length)
            self._prepare()
        tokens, times = [token], []
        for step in range(new_tokens - 1):
            started = time.perf_counter()
            self.ids.copy_(token)
            self.position.fill_(self.prompt_length + step)
            if self.graph is not None:
                self.graph.replay()
                token = _next(self.logits)
            else:
                token = _next(self._step())
            _sync(self.device)
            times.append(time.perf_counter() - started)
            tokens.append(token)
        return Steps(torch.cat(tokens, 1).cpu(), ttft, times)


def _generate_both(
    model: nn.Module, prompt: torch.Tensor, new_tokens: int, graph: GraphDecoder | str
) -> tuple[dict[str, Steps], GraphDecoder | str]:
    """One eager and one graph generation; a graph that cannot be captured becomes the reason why."""
    runs = {"eager": generate_eager(model, prompt, new_tokens)}
    if isinstance(graph, GraphDecoder):
        try:
            runs["graph"] = graph.generate(prompt, new_tokens)
        except RuntimeError as error:  # a forward that cannot be captured: say why
            graph = f"not captured: {str(error).splitlines()[0]}"
    return runs, graph


def time_on_device(
    models: dict[str, nn.Module], prompts: dict[int, torch.Tensor], new_tokens: int, rounds: int, device: torch.device
) -> list[dict]:
    """Every model in fp32 and bf16, eager and graph, at each batch, timed interleaved round by round."""
    rows: dict[tuple, dict] = {}
    for dtype_name, dtype in DTYPES.items():
        placed = {name: copy.deepcopy(m).to(device=device, dtype=dtype) for name, m in models.items()}
        graphs = {
            (name, b): GraphDecoder(model, b, prompt.shape[1], new_tokens, device)
            for name, model in placed.items()
            for b, prompt in prompts.items()
        }
        for _ in range(rounds + 1):  # the first round warms up and is not kept
            for (name, batch), graph in graphs.items():
                runs, graphs[(name, batch)] = _generate_both(placed[name], prompts[batch], new_tokens, graph)
                for mode, steps in runs.items():
                    rows.setdefault((name, dtype_name, mode, batch), {"rounds": []})["rounds"].append(steps)
                if isinstance(graphs[(name, batch)], str):
                    rows[(name, dtype_name, "graph", batch)] = {"error": graphs[(name, batch)]}
        del placed, graphs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return [_summarise(key, row, rows) for key, row in rows.items()]


def _summarise(key: tuple, row: dict, rows: dict) -> dict:
    """Medians over the kept rounds (the first warms up), and greedy agreement with eager's tokens."""
    name, dtype, mode, batch = key
    out = {"model": name, "dtype": dtype, "mode": mode, "batch": batch}
    if "error" in row:
        return {**out, "error": row["error"]}
    kept = row["rounds"][1:] or row["rounds"]
    eager = rows[(name, dtype, "eager", batch)]["rounds"][-1].tokens
    return {
        **out,
        "ttft_ms": 1000 * statistics.median(steps.ttft_s for steps in kept),
        "tpot_ms": 1000 * statistics.median(t for steps in kept for t in steps.tpot_s),
        "rows_greedy_equal_to_eager": int((kept[-1].tokens == eager).all(1).sum()),
    }


def score(model: nn.Module, data, dense: dict | None) -> dict:
    """Validation, test and out-of-domain perplexity, each with its paired 95 % ratio to dense's."""
    row: dict = {}
    for split in ("val", "test", "ood"):
        blocks = getattr(data, split)
        if blocks is None:
            continue
        result = perplexity(model, blocks)
        row[split] = {"perplexity": [result.value, result.low, result.high], "_score": result}
        if dense is not None:
            row[split]["ratio"] = list(paired_ratio_interval(result, dense[split]["_score"]))
    return row


def _public(row: dict) -> dict:
    """The row without its Perplexity objects (kept for paired ratios), for JSON."""
    return {split: {k: v for k, v in values.items() if k != "_score"} for split, values in row.items()}


def recover_on_device(
    dense: nn.Module,
    data,
    config,
    specs: list[str],
    device: torch.device,
    cpu_run: bool,
    results: dict,
    save: Callable[[], None],
) -> None:
    """Each `shape:tokens[:distill_weight]` cut, recovered on `device`, scored against dense, into `results`."""
    base = shape_of(dense.config)
    calibration = calibrate(dense, data.calibration)
    dense_scores = score(dense.to(device), data, None)
    dense.cpu()  # cuts are made on the CPU, beside the calibration statistics; recovery moves both
    results["dense"] = _public(dense_scores)
    for spec in specs:
        parts = spec.split(":")
        shape, tokens = parse_shape(spec, base), int(parts[3])
        if cpu_run:
            tokens = min(tokens, 4 * config.block_length)
        settings = replace(recovery_settings(config), max_tokens=tokens, device=str(device))
        if len(parts) > 4:
            settings = replace(settings, distill_weight=float(parts[4]))
        cut = cut_to_shape(dense, shape, calibration, "activation", True)
        before = score(cut.to(device), data, dense_scores)
        spent = recover_(cut, dense, data.train, settings)
        after = score(cut, data, dense_scores)
        results[spec] = {
            "shape": shape.describe(),
            "cut_only": _public(before),
            "recovered": _public(after),
            "recovery": {"tokens": spent.tokens, "steps": spent.steps, "wall_s": spent.wall_s, **asdict(settings)},
        }
        print(spec, json.dumps(_brief(results[spec])), flush=True)
        save()
        del cut


def _brief(result: dict) -> dict:
    recovered = result["recovered"]
    return {
        "tokens": result["recovery"]["tokens"],
        "wall_s": round(result["recovery"]["wall_s"], 1),
        **{f"{split} ratio": [round(x, 3) for x in recovered[split]["ratio"]] for split in recovered},
    }


def machine() -> dict:
    """Where the figures were measured."""
    info = {"python": platform.python_version(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    import transformers

    return {**info, "transformers": transformers.__version__}


def _ratio(cell: dict) -> str:
    ratio, low, high = cell["ratio"]
    return f"{ratio:.3f} [{low:.3f}, {high:.3f}]"


def render_latency(report: dict) -> list[str]:
    """The latency part as a markdown table: TPOT per mode, batch and dtype, and graph speed-ups over dense."""
    rows = {(r["model"], r["dtype"], r["mode"], r["batch"]): r for r in report["latency"] if "error" not in r}
    errors = [
        f"- {r['model']} {r['dtype']} batch {r['batch']}: {r['error']}" for r in report["latency"] if "error" in r
    ]
    batches = sorted({key[3] for key in rows})
    head = ["model", "shape", "dtype", "TTFT b1 (ms)"]
    head += [f"TPOT b{b} {mode} (ms)" for b in batches for mode in ("eager", "graph")]
    head += [f"graph b{b} vs dense" for b in batches]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dtype in DTYPES:
        for name, shape in report["shapes"].items():
            if (name, dtype, "eager", batches[0]) not in rows:
                continue
            cells = [name, shape, dtype, f"{rows[(name, dtype, 'eager', batches[0])]['ttft_ms']:.1f}"]
            for b in batches:
                cells += [
                    f"{rows[(name, dtype, m, b)]['tpot_ms']:.2f}" if (name, dtype, m, b) in rows else "–"
                    for m in ("eager", "graph")
                ]
            for b in batches:
                ours, dense = rows.get((name, dtype, "graph", b)), rows.get(("dense", dtype, "graph", b))
                cells.append(f"{dense['tpot_ms'] / ours['tpot_ms']:.2f}×" if ours and dense else "–")
            lines.append("| " + " | ".join(cells) + " |")
    return lines + errors


def render_recovery(results: dict) -> list[str]:
    """The recovery part as a markdown table: budget, time, throughput and paired perplexity ratios."""
    dense = results["dense"]
    splits = [s for s in ("val", "test", "ood") if s in dense]
    head = ["cut", "shape", "tokens", "wall (s)", "tokens/s", "distill weight", "compute"]
    head += [f"{s} ppl ratio, cut only" for s in splits] + [f"{s} ppl ratio, recovered" for s in splits]
    lines = [
        "Dense perplexity: " + ", ".join(f"{s} {dense[s]['perplexity'][0]:.2f}" for s in splits) + ".",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for spec, result in results.items():
        if spec == "dense":
            continue
        spent = result["recovery"]
        cells = [spec, result["shape"], f"{spent['tokens']:,}", f"{spent['wall_s']:.1f}"]
        cells += [f"{spent['tokens'] / spent['wall_s']:,.0f}", str(spent["distill_weight"]), spent["compute_dtype"]]
        cells += [_ratio(result[phase][s]) for phase in ("cut_only", "recovered") for s in splits]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render(reports: list[dict]) -> str:
    """Every saved report's parts as markdown, each under the machine it ran on."""
    out = ["# Decoder LLM on a CUDA device", ""]
    for report in reports:
        where = ", ".join(f"{k} {v}" for k, v in report["machine"].items())
        if "latency" in report:
            out += [f"## Decode latency ({report['latency_weights']} weights)", "", f"Machine: {where}.", ""]
            out += render_latency(report) + [""]
        if "recovery" in report:
            out += ["## Recovery on the GPU", "", f"Machine: {where}; model `{report['model']}`.", ""]
            out += render_recovery(report["recovery"]) + [""]
    return "\n".join(out)


def main() -> None:
    """Times the shapes and recovers the cuts on the CUDA device; writes JSON and prints a summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("studies/decoder-workload.yaml"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", help="the dense model (folder or .gguf) instead of the bench file's")
    parser.add_argument("--shapes", nargs="*", default=[], help="layers:mlp_width:kv_groups to time beside dense")
    parser.add_argument("--recover", nargs="*", default=[], help="layers:mlp:kv_groups:tokens[:distill_weight]")
    parser.add_argument(
        "--random-weights", action="store_true", help="time models of random weights (no data; --model: its config)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--latency", action=argparse.BooleanOptionalAction, default=True, help="time the shapes")
    parser.add_argument("--render", nargs="+", type=Path, help="only write OUT/gpu-decoder.md from saved reports")
    args = parser.parse_args()
    if args.render:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu-decoder.md").write_text(render([json.loads(p.read_text()) for p in args.render]))
        return
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        print("measure_decoder_gpu: no CUDA device here: running on the CPU as a check, not a measurement")
    torch.set_num_threads(torch.get_num_threads() if cuda else 2)
    config = load_bench_config(args.config).model_copy(update={"zero_shot": None})
    if args.model:
        config = config.model_copy(update={"model": args.model})
    if args.random_weights:  # the model's config.json is all that is read
        from transformers import AutoConfig, AutoModelForCausalLM

        dense, tokenizer = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config.model)).eval(), None
    else:
        dense, tokenizer = load_causal_lm(config.model)
    rounds, new_tokens = (args.rounds, config.new_tokens) if cuda else (1, 4)
    report: dict = {"machine": machine(), "config": str(args.config), "model": config.model}
    data = None if args.random_weights else workload_data(config, tokenizer)
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after each part, so that a run stopped at its time limit keeps what it measured
        (args.out / "gpu-decoder.json").write_text(json.dumps(report, indent=1, default=str))

    if args.recover and data is not None:
        report["recovery"] = {}
        recover_on_device(dense, data, config, args.recover, device, not cuda, report["recovery"], save)
    if args.latency:
        report.update(measure_latency(dense, data, config, args.shapes, device, rounds, new_tokens))
        for row in report["latency"]:
            print(json.dumps(row), flush=True)
        save()
    (args.out / "gpu-decoder.md").write_text(render([report]))
    print(f"wrote {args.out / 'gpu-decoder.json'} and gpu-decoder.md")


def measure_latency(
    dense: nn.Module, data, config, specs: list[str], device: torch.device, rounds: int, new_tokens: int
) -> dict:
    """TTFT and TPOT of dense and each shape on `device`: the workload's cuts, or random weights (no data)."""
    base = shape_of(dense.config)
    shapes = {"dense": base, **{spec: parse_shape(spec, base) for spec in specs}}
    if data is None:
        models = {name: dense if name == "dense" else cut_for_timing(dense, shape) for name, shape in shapes.items()}
    else:
        calibration = calibrate(dense, data.calibration)
        cut = {n: cut_to_shape(dense, s, calibration, "activation", True) for n, s in shapes.items() if n != "dense"}
        models = {"dense": dense, **cut}
    generator = np.random.default_rng(0)
    prompts = {
        b: torch.as_tensor(generator.integers(0, base.vocab, (b, config.prompt_length)), device=device)
        for b in config.batches
    }
    started = time.perf_counter()
    rows = time_on_device(models, prompts, new_tokens, rounds, device)
    return {
        "shapes": {name: shape.describe() for name, shape in shapes.items()},
        "latency_weights": "random" if data is None else "the workload's cuts",
        "latency_wall_s": time.perf_counter() - started,
        "latency": rows,
    }


if __name__ == "__main__":
    main()
