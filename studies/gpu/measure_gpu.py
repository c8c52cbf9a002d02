"""Measures the CUDA paths that the CPU machines cannot: 2:4 Linear kernels and CUDA latency.

Two parts, each timed in one process with its candidates interleaved round by round:

1. **2:4 semi-structured sparsity** (`prune.method: semi_structured`) on BERT-like encoders: the
   real MiniLM-L6 (when `--minilm DIR` holds its `config.json` + `model.safetensors`) and a
   BERT-base-shaped encoder of random weights (12 x 768 / 3072; timing does not depend on the
   values). Every encoder Linear gets the method's mask (`semi_structured_mask`), then
   `to_semi_structured_` converts it for cuSPARSELt and, separately, for CUTLASS. fp16, batch x 128
   tokens. Reported: ms per forward (median over interleaved rounds, each call synchronised, so it
   is what a caller waits), speed-up over dense fp16, the sparse kernels' agreement with the same
   masked weights run dense, and (MiniLM) how far one-shot 2:4 moves sentence embeddings.
2. **CUDA latency of pruned checkpoints** (`--checkpoints DIR`: one folder per model, each holding a
   `model.safetensors` written by the pipeline): fp32, eager and as a CUDA graph, at batch 1 and 64.
   The folder name `FAMILY--VARIANT` groups rows; speed-ups are against `FAMILY--dense`.

Usage:
    python studies/gpu/measure_gpu.py --out DIR [--minilm DIR] [--checkpoints DIR] [--rounds N]

Writes `DIR/gpu.json` and `DIR/gpu.md`. Without a CUDA device it says so and runs the same code on
the CPU with few repetitions and no 2:4 conversion (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pruneops.models.checkpoint import load_checkpoint  # noqa: E402
from pruneops.pruning.methods import (  # noqa: E402
    semi_structured_available,
    semi_structured_mask,
    to_semi_structured_,
)

SEQ = 128
SENTENCES = [
    "The film is a triumph of style over substance, and the style is glorious.",
    "A tedious, overlong mess that squanders a talented cast.",
    "Pruning removes channels so the network runs faster on the serving machine.",
    "The weather in the mountains changed quickly that afternoon.",
    "An uneven but often funny comedy with a big heart.",
    "Latency, not the count of multiply-accumulates, is what users pay for.",
    "She opened the window and the noise of the street came in.",
    "It never quite decides whether it is a thriller or a romance.",
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def interleaved_ms(
    candidates: dict[str, Callable[[], object]], device: torch.device, rounds: int, calls: int, warmup: int
) -> dict[str, dict[str, float]]:
    """Per-call milliseconds (each call synchronised) of every candidate, interleaved round by round.

    Returns:
        name -> {"median": ms, "p90": ms} over all calls of all rounds.
    """
    for fn in candidates.values():
        for _ in range(warmup):
            fn()
    _sync(device)
    samples: dict[str, list[float]] = {name: [] for name in candidates}
    names = list(candidates)
    for r in range(rounds):
        # Alternate the order so neither candidate always runs just after the other.
        for name in names if r % 2 == 0 else names[::-1]:
            fn = candidates[name]
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                _sync(device)
                samples[name].append((time.perf_counter() - t0) * 1e3)
    out = {}
    for name, values in samples.items():
        values.sort()
        out[name] = {"median": statistics.median(values), "p90": values[int(0.9 * (len(values) - 1))]}
    return out


def graph_of(model: nn.Module, x: torch.Tensor) -> Callable[[], object]:
    """`model(x)` captured as a CUDA graph (replays without per-kernel launch cost)."""
    static_x = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(static_x)
    return graph.replay


# --- 2:4 ---------------------------------------------------------------------------------------


def bert_encoder(config: dict, weights: Path | None) -> nn.Module:
    """A transformers BertModel from a config dict, with MiniLM's weights when given."""
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(**config), add_pooling_layer=False)
    if weights is not None:
        from safetensors.torch import load_file

        state = {k: v for k, v in load_file(str(weights)).items() if not k.startswith("pooler.")}
        state.pop("embeddings.position_ids", None)
        missing, unexpected = model.load_state_dict(state, strict=False)
        # position_ids is a buffer some transformers versions keep and others do not.
        missing = [k for k in missing if not k.endswith("position_ids")]
        if missing or unexpected:
            raise SystemExit(f"MiniLM weights do not fit BertModel: missing {missing}, unexpected {unexpected}")
    return model.eval()


def masks_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """The method's 2:4 mask for every encoder Linear."""
    return {
        f"{n}.weight": semi_structured_mask(m.weight)
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and m.in_features % 4 == 0
    }


@torch.no_grad()
def masked_copy(model: nn.Module, masks: dict[str, torch.Tensor]) -> nn.Module:
    """A copy of `model` with the masked weights zeroed (still dense tensors)."""
    out = copy.deepcopy(model)
    params = dict(out.named_parameters())
    for name, mask in masks.items():
        params[name].mul_(mask.to(params[name].device, params[name].dtype))
    return out


def sparse_copy(masked: nn.Module, masks: dict[str, torch.Tensor], cutlass: bool) -> nn.Module:
    """A copy of the masked model with its 2:4 weights converted for cuSPARSELt or CUTLASS."""
    from torch.sparse import SparseSemiStructuredTensor

    out = copy.deepcopy(masked)
    previous = SparseSemiStructuredTensor._FORCE_CUTLASS
    SparseSemiStructuredTensor._FORCE_CUTLASS = cutlass
    try:
        to_semi_structured_(out, masks)
    finally:
        SparseSemiStructuredTensor._FORCE_CUTLASS = previous
    return out


def mean_pooled(model: nn.Module, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    """Mean of the last hidden state over real tokens (sentence-transformers' pooling)."""
    hidden = model(input_ids=ids, attention_mask=attention).last_hidden_state.float()
    weights = attention.unsqueeze(-1).float()
    return (hidden * weights).sum(1) / weights.sum(1)


@torch.no_grad()
def embedding_shift(dense: nn.Module, masked: nn.Module, tokenizer_file: Path, device: torch.device) -> dict:
    """Cosine similarity of MiniLM sentence embeddings before and after one-shot 2:4 (no retraining)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    tok.enable_padding(pad_id=0)
    enc = tok.encode_batch(SENTENCES)
    ids = torch.tensor([e.ids for e in enc], device=device)
    attention = torch.tensor([e.attention_mask for e in enc], device=device)
    a, b = mean_pooled(dense, ids, attention), mean_pooled(masked, ids, attention)
    cos = torch.nn.functional.cosine_similarity(a, b)
    # Does the sparse model still rank sentence pairs as the dense one does?
    sim_a, sim_b = (torch.nn.functional.normalize(t, dim=1) for t in (a, b))
    pairs = torch.triu_indices(len(SENTENCES), len(SENTENCES), 1)
    ra = (sim_a @ sim_a.T)[pairs[0], pairs[1]]
    rb = (sim_b @ sim_b.T)[pairs[0], pairs[1]]
    ranks = torch.stack([ra.argsort().argsort().float(), rb.argsort().argsort().float()])
    rank_corr = float(torch.corrcoef(ranks)[0, 1])
    return {"cosine_min": float(cos.min()), "cosine_mean": float(cos.mean()), "pair_rank_spearman": rank_corr}


@torch.no_grad()
def measure_semi_structured(
    name: str, model: nn.Module, device: torch.device, batches: list[int], args: argparse.Namespace
) -> dict:
    """Dense fp16 vs 2:4 (cuSPARSELt, CUTLASS) forward latency of one encoder."""
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    dense = model.to(device, dtype)
    masks = masks_of(dense)
    masked = masked_copy(dense, masks)
    result: dict = {"linears": len(masks), "rows": []}
    variants: dict[str, nn.Module] = {"dense": dense}
    reason = semi_structured_available()
    if reason is None:
        for kernel, cutlass in (("cusparselt", False), ("cutlass", True)):
            try:
                sparse = sparse_copy(masked, masks, cutlass)
                sparse(input_ids=torch.randint(1000, 2000, (1, SEQ), device=device))
                variants[f"2:4 {kernel}"] = sparse
            except (RuntimeError, ValueError, NotImplementedError) as exc:
                result.setdefault("errors", {})[kernel] = f"{type(exc).__name__}: {exc}"[:300]
    else:
        result["skipped"] = f"2:4 kernels not run: {reason}"
    vocab = model.config.vocab_size
    for batch in batches:
        ids = torch.randint(1000, vocab, (batch, SEQ), device=device)
        ref = masked(input_ids=ids).last_hidden_state.float()
        row: dict = {"batch": batch, "tokens": batch * SEQ}
        for label, m in variants.items():
            if label.startswith("2:4"):
                out = m(input_ids=ids).last_hidden_state.float()
                row[f"{label} max_abs_diff_vs_masked_dense"] = float((out - ref).abs().max())
        timed = interleaved_ms(
            {label: (lambda m=m, ids=ids: m(input_ids=ids)) for label, m in variants.items()},
            device,
            args.rounds,
            args.calls,
            args.warmup,
        )
        row["ms"] = {label: t["median"] for label, t in timed.items()}
        row["p90_ms"] = {label: t["p90"] for label, t in timed.items()}
        row["speedup"] = {label: timed["dense"]["median"] / t["median"] for label, t in timed.items()}
        result["rows"].append(row)
        print(f"[2:4] {name} batch {batch}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row["ms"].items()), flush=True)
    if args.minilm and name.startswith("MiniLM"):
        result["embedding_shift_one_shot"] = embedding_shift(dense, masked, args.minilm / "tokenizer.json", device)
    return result


# --- 2:4 kernels, one Linear at a time ------------------------------------------------------------

KERNEL_SHAPES = [(1536, 384), (384, 1536), (3072, 768), (768, 3072), (8192, 8192)]


def events_ms(fn: Callable[[], object], calls: int = 100) -> float:
    """GPU milliseconds per call over `calls` back-to-back calls (no synchronisation between them)."""
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


@torch.no_grad()
def measure_kernels(device: torch.device) -> list[dict]:
    """Dense vs 2:4 `F.linear` (2-D input) and the raw cuSPARSELt matmul, per Linear shape and rows."""
    from torch.sparse import to_sparse_semi_structured

    rows = []
    for out_f, in_f in KERNEL_SHAPES:
        w = torch.randn(out_f, in_f, device=device, dtype=torch.float16)
        w = w * semi_structured_mask(w)
        ws = to_sparse_semi_structured(w)
        for m in (128, 8192):
            x = torch.randn(m, in_f, device=device, dtype=torch.float16)
            row = {"out": out_f, "in": in_f, "rows": m}
            row["dense_ms"] = events_ms(lambda w=w, x=x: torch.nn.functional.linear(x, w))
            row["sparse_linear_ms"] = events_ms(lambda ws=ws, x=x: torch.nn.functional.linear(x, ws))
            packed = getattr(ws, "packed", None)
            if packed is not None:
                xt = x.t().contiguous()
                row["raw_cslt_ms"] = events_ms(lambda p=packed, xt=xt: torch._cslt_sparse_mm(p, xt))
            rows.append(row)
            print("[kernel] " + json.dumps(row), flush=True)
    return rows


# --- CUDA latency of checkpoints ----------------------------------------------------------------


@torch.no_grad()
def measure_checkpoints(folder: Path, device: torch.device, args: argparse.Namespace) -> dict:
    """fp32 latency (eager and CUDA graph) of every pipeline checkpoint under `folder`, by family."""
    families: dict[str, dict[str, nn.Module]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    params: dict[str, int] = {}
    for path in sorted(folder.glob("*/model.safetensors")):
        family, _, variant = path.parent.name.partition("--")
        ckpt = load_checkpoint(path)
        families.setdefault(family, {})[variant] = ckpt.model.to(device).eval()
        shapes[family] = tuple(ckpt.spec.input_shape)
        params[f"{family}--{variant}"] = sum(p.numel() for p in ckpt.model.parameters())
    out: dict = {}
    for family, models in families.items():
        rows = []
        for batch in (1, 64):
            x = torch.randn(batch, *shapes[family], device=device)
            cands: dict[str, Callable[[], object]] = {}
            for variant, model in models.items():
                cands[f"{variant} eager"] = lambda m=model, x=x: m(x)
                if device.type == "cuda":
                    cands[f"{variant} graph"] = graph_of(model, x)
            timed = interleaved_ms(cands, device, args.rounds, args.calls, args.warmup)
            rows.append({"batch": batch, "ms": {k: v["median"] for k, v in timed.items()}})
            print(f"[ckpt] {family} batch {batch}: " + ", ".join(f"{k} {v['median']:.4f}" for k, v in timed.items()))
        out[family] = {"params": {v: params[f"{family}--{v}"] for v in models}, "rows": rows}
    return out


# --- report -------------------------------------------------------------------------------------


def _encoder_md(name: str, enc: dict) -> list[str]:
    lines = [f"## 2:4 on {name} ({enc['linears']} Linear layers, fp16, seq {SEQ})", ""]
    if "skipped" in enc:
        lines += [enc["skipped"], ""]
    lines += [f"- {kernel} failed: {err}" for kernel, err in enc.get("errors", {}).items()]
    labels = list(enc["rows"][0]["ms"])
    lines += ["| batch | tokens | " + " | ".join(f"{x} ms" for x in labels) + " | speed-up |"]
    lines += ["|---" * (len(labels) + 3) + "|"]
    for row in enc["rows"]:
        speed = ", ".join(f"{k} {v:.2f}x" for k, v in row["speedup"].items() if k != "dense")
        cells = " | ".join(f"{row['ms'][x]:.3f}" for x in labels)
        lines += [f"| {row['batch']} | {row['tokens']} | {cells} | {speed} |"]
    if "embedding_shift_one_shot" in enc:
        lines += ["", f"One-shot 2:4, no retraining: {json.dumps(enc['embedding_shift_one_shot'])}"]
    return [*lines, ""]


def _kernels_md(kernels: list[dict]) -> list[str]:
    lines = ["## 2:4 kernels, one Linear (fp16, ms per call, back-to-back)", ""]
    lines += ["| out x in | rows | dense | 2:4 F.linear | raw _cslt_sparse_mm |", "|---|---|---|---|---|"]
    for k in kernels:
        raw = f"{k['raw_cslt_ms']:.4f}" if "raw_cslt_ms" in k else "–"
        shape = f"{k['out']}x{k['in']}"
        lines += [f"| {shape} | {k['rows']} | {k['dense_ms']:.4f} | {k['sparse_linear_ms']:.4f} | {raw} |"]
    return [*lines, ""]


def _checkpoints_md(family: str, fam: dict) -> list[str]:
    lines = [f"## CUDA latency, {family} (fp32, ms per call)", ""]
    lines += ["| variant | params | b1 eager | b1 graph | b64 eager | b64 graph |", "|---|---|---|---|---|---|"]
    for v in fam["params"]:
        cells = []
        for row in fam["rows"]:
            for mode in ("eager", "graph"):
                ms = row["ms"].get(f"{v} {mode}")
                cells.append("–" if ms is None else f"{ms:.4f}")
        lines += [f"| {v} | {fam['params'][v]} | " + " | ".join(cells) + " |"]
    return [*lines, ""]


def markdown(report: dict) -> str:
    """The measurements as Markdown tables."""
    lines = [f"# GPU measurements ({report['device']})", "", f"`{report['command']}`", ""]
    for name, enc in report.get("semi_structured", {}).items():
        lines += _encoder_md(name, enc)
    if report.get("kernels"):
        lines += _kernels_md(report["kernels"])
    for family, fam in report.get("checkpoints", {}).items():
        lines += _checkpoints_md(family, fam)
    return "\n".join(lines)


def main() -> int:
    """Runs both parts and writes the report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minilm", type=Path, help="folder with MiniLM-L6's config.json, model.safetensors")
    parser.add_argument("--checkpoints", type=Path, help="folder of FAMILY--VARIANT/model.safetensors")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--skip-bert-base", action="store_true")
    parser.add_argument("--kernels-only", action="store_true", help="only the per-Linear 2:4 kernel timings")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        print("no CUDA device: running the script's code on the CPU with few repetitions (not a measurement)")
        args.rounds, args.calls, args.warmup = 2, 2, 1
    report: dict = {
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name() if cuda else f"CPU {platform.processor() or platform.machine()}",
        "torch": torch.__version__,
        "cusparselt": getattr(torch.backends, "cusparselt", None) and torch.backends.cusparselt.version(),
        "semi_structured": {},
    }
    print(json.dumps({k: report[k] for k in ("device", "torch", "cusparselt")}), flush=True)
    if cuda:
        report["kernels"] = measure_kernels(device)
    if args.kernels_only:
        args.minilm = args.checkpoints = None
        args.skip_bert_base = True
    encoders = []
    if args.minilm:
        config = json.loads((args.minilm / "config.json").read_text())
        keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        encoders.append(("MiniLM-L6", {k: config[k] for k in keep}, args.minilm / "model.safetensors"))
    if not args.skip_bert_base:
        shape = dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12, num_attention_heads=12)
        encoders.append(("BERT-base shape, random weights", {**shape, "intermediate_size": 3072}, None))
    batches = [1, 8, 64] if cuda else [1, 2]
    for name, config, weights in encoders:
        torch.manual_seed(0)
        report["semi_structured"][name] = measure_semi_structured(
            name, bert_encoder(config, weights), device, batches, args
        )
    if args.checkpoints:
        report["checkpoints"] = measure_checkpoints(args.checkpoints, device, args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu.json").write_text(json.dumps(report, indent=1))
    (args.out / "gpu.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
