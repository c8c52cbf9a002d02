"""onnxruntime-genai's builder and generation loop: a causal LM exported, timed and run where it serves.

`build_genai_model` exports a HuggingFace folder (uniform shapes, so its config describes it)
with onnxruntime-genai's model builder in a precision (fp32; int8 or int4 weight-only
MatMulNBits) and pins the session's threads. `time_generation` times, for each model and
interleaved in rounds so that machine drift hits every model alike, the time to first token
(prefill of a prompt of `prompt_length` tokens, then the first token) and the time per output
token (each further greedy step with the KV cache), at a batch size. Requires the `llm` extra.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

import numpy as np

import pruneops.runtimes.genai.builder_main as builder_main
from pruneops.core.errors import PruneOpsError
from pruneops.runtimes.genai.scoring import decoder_window
from pruneops.timing.generation import DecodeWorkload, GenerationTiming, time_interleaved

PRECISIONS = ("fp32", "int8", "int4")


def build_genai_model(hf_folder: str | Path, out: str | Path, precision: str = "fp32", threads: int = 1) -> Path:
    """Exports a causal LM folder with onnxruntime-genai's builder (CPU) and pins its threads.

    The builder runs in this process (`builder_main.build`), its output in `out/build.log`.

    Raises:
        PruneOpsError: The builder failed (its error, else its log's last line, is in the message).
    """
    if precision not in PRECISIONS:
        raise PruneOpsError(f"decode export: precision {precision!r} is not one of {PRECISIONS}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "build.log"
    arguments = ["-i", str(hf_folder), "-o", str(out), "-p", precision, "-e", "cpu"]
    failure: BaseException | None = None
    try:
        builder_main.build(arguments, log)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the builder's reason goes into the message
        failure = exc
    if failure is not None or not (out / "genai_config.json").is_file():
        # An exception's own last line (`KeyError: 'rope_type'`); the log's for the parser's exit or no exception.
        reason = [] if failure is None or isinstance(failure, SystemExit) else traceback.format_exception_only(failure)
        lines = reason or log.read_text(errors="replace").strip().splitlines() or ["(no output)"]
        raise PruneOpsError(
            f"decode export: the onnxruntime-genai builder failed on {hf_folder}: {lines[-1].strip()[:300]}"
        )
    config_path = out / "genai_config.json"
    config = json.loads(config_path.read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    options["intra_op_num_threads"] = threads
    options["inter_op_num_threads"] = 1
    config_path.write_text(json.dumps(config, indent=2))
    return out


def sliding_window(folder: str | Path) -> int:
    """The local attention window of an exported model folder (0: none): `window_of` its config."""
    return window_of(json.loads((Path(folder) / "genai_config.json").read_text())["model"])


def window_of(model: dict) -> int:
    """The local attention window of an exported model (0: none): its KV cache must hold at least that many.

    Args:
        model: The `model` block of its `genai_config.json`.

    At most the model's context length (no generation is longer).
    """
    window = decoder_window(model.get("decoder", {}))
    return min(window, int(model.get("context_length", window)))


def generate_once(
    model: object, prompt: np.ndarray, new_tokens: int, window: int = 0
) -> tuple[float, list[float], np.ndarray]:
    """One greedy generation; returns (time to first token, per-step times, generated tokens).

    `window`: the model's sliding window (`sliding_window`): the cache is sized to hold it (Gemma 2
    and 3 refuse a shorter one) while exactly `new_tokens` are generated.
    """
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    length = prompt.shape[1] + new_tokens
    # min_length = length: end-of-sequence is never chosen, so every run times `new_tokens` steps.
    capacity = max(length, window)
    params.set_search_options(max_length=capacity, min_length=length, do_sample=False, batch_size=prompt.shape[0])
    generator = og.Generator(model, params)
    start = time.perf_counter()
    generator.append_tokens(prompt)
    generator.generate_next_token()
    first = time.perf_counter() - start
    steps, tokens = [], [generator.get_next_tokens().copy()]
    for _ in range(new_tokens - 1):
        if generator.is_done():
            break
        tick = time.perf_counter()
        generator.generate_next_token()
        steps.append(time.perf_counter() - tick)
        tokens.append(generator.get_next_tokens().copy())
    return first, steps, np.stack(tokens, axis=1)


def time_generation(
    models: dict[str, str | Path],
    prompt: np.ndarray,
    new_tokens: int = 64,
    rounds: int = 5,
    warmup: int = 1,
) -> dict[str, GenerationTiming]:
    """Times every model interleaved: per round, one generation of each in turn.

    Args:
        models: Name -> onnxruntime-genai model folder.
        prompt: (batch, prompt_length) int token ids (the same prompt for every model).
        new_tokens: Tokens generated per run (the first is the TTFT's; the rest time decoding).
        rounds: Timed rounds (the medians are over them).
        warmup: Untimed generations of each model first.
    """
    opened = {name: GenaiTimed(path) for name, path in models.items()}
    return time_interleaved(opened, DecodeWorkload(np.asarray(prompt), new_tokens, rounds, warmup))


class GenaiTimed:
    """An onnxruntime-genai folder loaded for timed greedy generations (`time_interleaved`'s protocol)."""

    def __init__(self, folder: str | Path):
        import onnxruntime_genai as og

        self.model = og.Model(str(folder))
        self.window = sliding_window(folder)

    def generate_timed(self, prompt: np.ndarray, new_tokens: int) -> tuple[float, list[float], np.ndarray]:
        """One greedy generation: time to first token, per-step times, tokens."""
        return generate_once(self.model, np.ascontiguousarray(prompt, dtype=np.int32), new_tokens, self.window)


def greedy_tokens(model_folder: str | Path, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    """Greedy continuation of a prompt by an onnxruntime-genai model, (batch, new_tokens)."""
    import onnxruntime_genai as og

    model, window = og.Model(str(model_folder)), sliding_window(model_folder)
    return generate_once(model, np.ascontiguousarray(prompt, dtype=np.int32), new_tokens, window)[2]


def exported_block_losses(model_folder: str | Path, blocks: np.ndarray, threads: int = 2) -> np.ndarray:
    """Mean next-token NLL of each block under an exported model (prefill with an empty cache).

    What a quantised candidate is judged by: its own logits in ONNX Runtime, not torch's.

    Args:
        model_folder: An onnxruntime-genai model folder (`model.onnx` and `genai_config.json`).
        blocks: (n, length) token ids.
        threads: ONNX Runtime intra-op threads.
    """
    from pruneops.runtimes.genai.scoring import open_scorer, prefill_losses

    session, decoder = open_scorer(Path(model_folder), threads)
    return np.asarray([prefill_losses(session, decoder, block).mean() for block in np.asarray(blocks)])
