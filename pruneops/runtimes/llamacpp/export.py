"""A torch causal LM written as GGUF files, one per precision, by llama.cpp's own converter and quantizer.

The converter (`convert_hf_to_gguf.py`, with the `gguf` package) reads a HuggingFace folder and
knows the families llama.cpp runs, tokenizer included; fp32, F16 and Q8_0 are its output types.
K-quants (Q4_K_M) have no Python quantizer: llama.cpp's `llama_model_quantize`, through
`llama-cpp-python`, makes them from the fp32 file, as a llama.cpp user's `llama-quantize` would.
Both come from the `llama-cpp-python` sdist, which `make llama-cpp` builds: the library into the
virtual environment, the converter beside it (`<venv>/share/llama.cpp/`, or `$PRUNEOPS_LLAMA_CPP`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from pruneops.core.errors import PruneOpsError
from pruneops.core.io import dump_json
from pruneops.core.progress import progress
from pruneops.models.decoders import save_causal_lm
from pruneops.pruning.decoder_vocabulary import OutputHead
from pruneops.runtimes.llamacpp.model import MODEL_FILE, LlamaCppModel

# Precision -> the converter's --outtype, or the llama.cpp file type a quantizer makes from fp32.
CONVERTED = {"fp32": "f32", "f16": "f16", "q8_0": "q8_0"}
QUANTIZED = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
CONVERTER_FILE = "convert_hf_to_gguf.py"
# The tokenizer's files, copied beside each GGUF file (llama.cpp reads its own copy inside the file).
TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "chat_template")
LOAD_CHECK_FILE = "load_check.json"  # what `check_loaded_back` measured on the file


def converter_path() -> Path:
    """llama.cpp's converter: `$PRUNEOPS_LLAMA_CPP/convert_hf_to_gguf.py`, else `<venv>/share/llama.cpp/`.

    Raises:
        PruneOpsError: It is not there (`make llama-cpp` puts it there).
    """
    folder = Path(os.environ.get("PRUNEOPS_LLAMA_CPP") or Path(sys.prefix) / "share" / "llama.cpp")
    path = folder / CONVERTER_FILE
    if not path.is_file():
        raise PruneOpsError(
            f"GGUF export needs llama.cpp's converter, not found at {path}: run `make llama-cpp` "
            "(builds llama-cpp-python from its PyPI sdist and keeps the converter), or set PRUNEOPS_LLAMA_CPP"
        )
    return path


def convert(hf_folder: Path, out: Path, outtype: str) -> Path:
    """One GGUF file from a HuggingFace folder by llama.cpp's converter.

    Raises:
        PruneOpsError: The converter failed (its last line, e.g. a family or tokenizer it does not know).
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    command = [sys.executable, str(converter_path()), str(hf_folder), "--outtype", outtype, "--outfile", str(out)]
    with log.open("w") as handle:
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0 or not out.is_file():
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        reason = next((line for line in reversed(lines) if "Error" in line), lines[-1] if lines else "(no output)")
        raise PruneOpsError(f"GGUF export: llama.cpp's converter failed on {hf_folder}: {reason.strip()[:300]}")
    log.unlink()
    return out


def quantize(source: Path, out: Path, ftype: str, threads: int) -> Path:
    """`source` (fp32 GGUF) requantised by llama.cpp to `ftype` (a `llama_cpp.LLAMA_FTYPE_*` name).

    Raises:
        PruneOpsError: llama-cpp-python is not built here, or the quantizer failed.
    """
    try:
        import llama_cpp
    except ImportError as exc:
        raise PruneOpsError(f"GGUF {ftype}: needs llama-cpp-python (`make llama-cpp`): {exc}") from exc
    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, ftype)
    params.nthread = threads
    code = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    if code != 0 or not out.is_file():
        raise PruneOpsError(f"GGUF {ftype}: llama.cpp's quantizer failed on {source} (code {code})")
    return out


def export_gguf(
    model: torch.nn.Module, tokenizer: object, folder: Path, precisions: list[str], threads: int
) -> dict[str, Path]:
    """GGUF folders of `model`, one per precision (`folder/<precision>/model.gguf`).

    A model whose output vocabulary is cut (`OutputHead`) is written with its head padded to the
    full vocabulary (the same logits: GGUF has no gathered head), so it gains nothing from the cut here.
    """
    head, tied = model.get_output_embeddings(), model.config.tie_word_embeddings
    if isinstance(head, OutputHead):
        padded = torch.nn.Linear(head.weight.shape[1], head.index.numel(), bias=False)
        padded.weight = torch.nn.Parameter(head.padded_weight())
        model.set_output_embeddings(padded)
        model.config.tie_word_embeddings = False
    try:
        hf = save_causal_lm(model, tokenizer, folder / "hf")
        out = _written(model, hf, folder, precisions, threads)
    finally:
        model.set_output_embeddings(head)
        model.config.tie_word_embeddings = tied
    return out


def _written(model: torch.nn.Module, hf: Path, folder: Path, precisions: list[str], threads: int) -> dict[str, Path]:
    """Each precision's GGUF folder, converted or quantised from fp32, every file checked by reading it back.

    The check's largest logit difference from the model is kept beside the file (`load_check.json`).
    """
    out: dict[str, Path] = {}
    fp32 = folder / "fp32" / MODEL_FILE
    try:
        for precision in progress(precisions, "GGUF export", len(precisions), "precisions"):
            target = folder / precision / MODEL_FILE
            if precision in CONVERTED:
                convert(hf, target, CONVERTED[precision])
            else:
                if not fp32.is_file():
                    convert(hf, fp32, "f32")
                quantize(fp32, target, QUANTIZED[precision], threads)
            error = check_loaded_back(model, target, precision)
            record = {"precision": precision, "tokens": CHECK_TOKENS, "largest_logit_difference": error}
            dump_json(record, target.parent / LOAD_CHECK_FILE)
            for file in hf.iterdir():  # the tokenizer beside the file: what serving tokenises with, digests cover
                if file.name.startswith(TOKENIZER_FILES):
                    shutil.copy(file, target.parent / file.name)
            out[precision] = target.parent
        if "fp32" not in precisions and fp32.is_file():
            shutil.rmtree(fp32.parent)
    finally:
        shutil.rmtree(hf)
    return out


CHECK_TOKENS = 16  # positions of the load-back check (one random sequence)


def _rounded(model: torch.nn.Module, precision: str) -> torch.nn.Module:
    """`model` with its matrices through `precision`'s rounding, as the converter writes them (fp32: the model itself).

    fp32 keeps every weight, F16 rounds each matrix to half precision, Q8_0 quantises each matrix
    whose rows split into 32-wide blocks (the others in F16); vectors (norms, biases) stay fp32.
    """
    import copy

    from gguf import GGMLQuantizationType, quants

    if precision == "fp32":
        return model
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for param in rounded.parameters():
            if param.dim() != 2:
                continue
            array = param.detach().numpy()
            if precision == "q8_0" and array.shape[-1] % 32 == 0:
                kind = GGMLQuantizationType.Q8_0
                param.copy_(torch.from_numpy(quants.dequantize(quants.quantize(array, kind), kind)))
            else:
                param.copy_(torch.from_numpy(array.astype(np.float16).astype(np.float32)))
    return rounded


def check_loaded_back(model: torch.nn.Module, file: Path, precision: str) -> float:
    """Reads `file` back and compares its logits with the model's.

    Read by transformers' GGUF reader where it knows the architecture, else by llama.cpp where it is
    built. Through transformers, fp32, F16 and Q8_0 must give the logits of the torch model with its
    matrices rounded as that format rounds them, within 1e-3 of the logits' scale (the file holds
    the same numbers, under llama.cpp's names and layouts); through llama.cpp, which also rounds
    activations for F16 and Q8_0 matrices, fp32 must meet the same bound and F16 and Q8_0 twice the
    error that the format's rounding of the weights alone makes, plus that. Q4_K_M (llama.cpp's own
    quantizer, no Python twin) must read back with finite logits; its quality is what the
    pipeline's budgets judge.

    Returns:
        The largest logit difference from the torch model (rounded as above; as it is for Q4_K_M).

    Raises:
        PruneOpsError: Neither reader can read the file, or its logits are not the model's.
    """
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, CHECK_TOKENS), generator=torch.Generator().manual_seed(0))
    reference = model.eval() if precision in QUANTIZED else _rounded(model, precision).eval()
    with torch.inference_mode():
        expected = reference(ids).logits[0]
    got, reader = _read_back(model, file, ids, precision)
    error = float((got - expected).abs().max())
    bound = 1e-3 * (1.0 + float(expected.abs().max()))
    if reader == "llama.cpp" and precision not in ("fp32", *QUANTIZED):
        with torch.inference_mode():  # the rounding of the weights alone: the unrounded model's logits
            bound += 2 * float((expected - model.eval()(ids).logits[0]).abs().max())
    if not torch.isfinite(got).all() or (precision not in QUANTIZED and error > bound):
        raise PruneOpsError(
            f"GGUF {precision}: {file} read back by {reader} gives other logits than the model "
            f"(largest difference {error:.3g}, allowed {bound:.3g})"
        )
    return error


def _read_back(model: torch.nn.Module, file: Path, ids: torch.Tensor, precision: str) -> tuple[torch.Tensor, str]:
    """The file's logits on `ids` and which reader gave them (transformers, else llama.cpp)."""
    from transformers import AutoModelForCausalLM

    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            file.parent, gguf_file=file.name, config=model.config, dtype=torch.float32
        ).eval()
    except Exception as exc:  # noqa: BLE001 - the reader's reason goes into the message
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    else:
        with torch.inference_mode():
            return loaded(ids).logits[0], "transformers"
    try:
        opened = LlamaCppModel(file.parent, threads=1, context=max(64, ids.shape[1]), exact_cache=True)
        logits = opened.logits(ids[0].numpy())
    except PruneOpsError as exc:
        raise PruneOpsError(
            f"GGUF {precision}: cannot check {file}: transformers cannot read it ({reason}) and {exc}"
        ) from exc
    return torch.from_numpy(logits), "llama.cpp"


def family_problem(model: torch.nn.Module, tokenizer: object) -> str | None:
    """Why llama.cpp cannot serve this model's family here (None: it can), from a small random copy.

    llama-cpp-python must be built and the converter present; then a copy of the family with two
    layers, the model's vocabulary and random weights (`family_probe`) is converted to fp32 GGUF
    and must give torch's greedy tokens and per-block losses in llama.cpp (relative 1e-3: llama.cpp
    keeps its attention cache in F16). A family the converter does not know, or converts into
    something llama.cpp computes otherwise, shows here in seconds.
    """
    import tempfile

    from pruneops.models.decoders import PROBE_TOKENS, family_probe

    try:
        import llama_cpp  # noqa: F401 - only whether it is built
    except ImportError:
        return "llama-cpp-python is not built here (`make llama-cpp`)"
    probe = family_probe(model, full_vocabulary=True)
    with tempfile.TemporaryDirectory(prefix="pruneops-gguf-probe-") as work:
        try:
            folder = export_gguf(probe.model, tokenizer, Path(work), ["fp32"], threads=1)["fp32"]
            opened = LlamaCppModel(folder, threads=1, context=64, exact_cache=True)
            tokens = opened.greedy(probe.blocks[:1, :8].numpy(), PROBE_TOKENS)[0].tolist()
            losses = opened.losses(probe.blocks.numpy())
        except PruneOpsError as exc:
            return str(exc).strip().splitlines()[-1][:300]
    if tokens != probe.greedy:
        return f"its GGUF generates other tokens than transformers ({tokens} vs {probe.greedy})"
    reference = probe.losses.numpy()
    if not np.allclose(losses, reference, rtol=1e-3):
        return f"its GGUF scores text otherwise than transformers (losses {losses.round(4)} vs {reference.round(4)})"
    return None
