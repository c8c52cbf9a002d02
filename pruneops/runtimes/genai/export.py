"""A torch causal LM written as onnxruntime-genai folders, one per precision (the builder reads a HF folder)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from pruneops.core.errors import PruneOpsError
from pruneops.core.progress import progress
from pruneops.models.decoders import PROBE_TOKENS, family_probe, save_causal_lm
from pruneops.pruning.decoder_vocabulary import OutputHead
from pruneops.runtimes.genai.generation import build_genai_model, exported_block_losses, greedy_tokens


def export_model(
    model: torch.nn.Module, tokenizer: object, folder: Path, precisions: list[str], threads: int
) -> dict[str, Path]:
    """onnxruntime-genai folders of `model`, one per precision (`folder/<precision>`).

    A model whose vocabulary is cut (`OutputHead`) is built with its head padded to the full
    vocabulary, a plain untied projection the builder reads, and each export is then cut back.
    """
    head = model.get_output_embeddings()
    if not isinstance(head, OutputHead):
        head = None
        hf = save_causal_lm(model, tokenizer, folder / "hf")
    else:
        padded = torch.nn.Linear(head.weight.shape[1], head.index.numel(), bias=False)
        padded.weight = torch.nn.Parameter(head.padded_weight())
        model.set_output_embeddings(padded)
        try:
            hf = save_causal_lm(model, tokenizer, folder / "hf")
        finally:
            model.set_output_embeddings(head)
    out = {
        p: build_genai_model(hf, folder / p, p, threads)
        for p in progress(precisions, "export", len(precisions), "precisions")
    }
    if head is not None:
        for exported in out.values():
            restrict_exported_head(exported, head)
    shutil.rmtree(hf)  # the exported folders are what is timed and scored
    return out


def family_problem(model: torch.nn.Module, tokenizer: object) -> str | None:
    """Why the builder cannot serve this model's family (None: it can), from a small random copy.

    The copy (`family_probe`: the family, the attention geometry and every per-layer setting of
    its first two layers, a 512-token vocabulary, random weights) is exported in fp32 and must give
    torch's greedy tokens and per-block losses (relative 5e-4). That catches a builder that refuses
    the config and one that builds it but computes something else (OLMo with builder 0.18), in
    seconds, before any stage times or cuts the real model.
    """
    import tempfile

    probe = family_probe(model)
    with tempfile.TemporaryDirectory(prefix="pruneops-family-probe-") as work:
        hf = save_causal_lm(probe.model, tokenizer, Path(work) / "hf")
        try:
            folder = build_genai_model(hf, Path(work) / "fp32", "fp32", threads=1)
            exported = np.asarray(greedy_tokens(folder, probe.blocks[:1, :8].numpy(), PROBE_TOKENS))
            losses = exported_block_losses(folder, probe.blocks.numpy(), threads=1)
        except Exception as exc:  # noqa: BLE001 - whatever the builder or the runtime raised is the reason
            return str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
    if exported[0].tolist() != probe.greedy:
        return f"its export generates other tokens than transformers ({exported[0].tolist()} vs {probe.greedy})"
    reference = probe.losses.numpy()
    if not np.allclose(losses, reference, rtol=5e-4):
        return f"its export scores text otherwise than transformers (losses {losses.round(4)} vs {reference.round(4)})"
    return None


def restrict_exported_head(folder: Path, head: OutputHead) -> None:
    """Cuts an onnxruntime-genai export's padded output projection to the head's rows, then gathers.

    The export was built with `head.padded_weight()` as an untied `lm_head`; its last node (MatMul
    over fp32 weights, or MatMulNBits over quantised rows) is cut to its first `K + C` outputs, then a
    Gather over the index map and an Add of the offsets follow, so `logits` stays `V` wide.

    Raises:
        PruneOpsError: The graph does not end in the output projection this expects.
    """
    import onnx
    from onnx import helper, numpy_helper

    path = folder / "model.onnx"
    graph_model = onnx.load(str(path))
    graph = graph_model.graph
    node = next((n for n in graph.node if "logits" in n.output), None)
    if node is None or node.op_type not in ("MatMul", "MatMulNBits"):
        raise PruneOpsError(f"vocabulary cut: {path} has no MatMul or MatMulNBits producing logits")
    rows, columns = head.weight.shape[0], head.index.numel()
    initializers = {i.name: i for i in graph.initializer}
    if node.op_type == "MatMul":
        _replace(initializers[node.input[1]], numpy_helper.to_array(initializers[node.input[1]])[:, :rows])
    else:
        # MatMulNBits inputs: A, B, scales, zero_points, g_idx, bias; all but A and g_idx are per output row.
        per_row = [name for index, name in enumerate(node.input) if name and index in (1, 2, 3, 5)]
        for name in per_row:
            _replace(initializers[name], _first_rows(numpy_helper.to_array(initializers[name]), columns, rows))
        for attribute in node.attribute:
            if attribute.name == "N":
                attribute.i = rows
    node.output[0] = "logits_head_rows"
    graph.initializer.extend(
        [
            numpy_helper.from_array(head.index.numpy().astype(np.int64), "logits_vocabulary_index"),
            numpy_helper.from_array(head.offset.detach().numpy().astype(np.float32), "logits_vocabulary_offset"),
        ]
    )
    graph.node.extend(
        [
            helper.make_node("Gather", ["logits_head_rows", "logits_vocabulary_index"], ["logits_gathered"], axis=-1),
            helper.make_node("Add", ["logits_gathered", "logits_vocabulary_offset"], ["logits"]),
        ]
    )
    data = path.with_name("model.onnx.data")
    data.unlink(missing_ok=True)
    onnx.save(graph_model, str(path), save_as_external_data=True, location=data.name, size_threshold=1024)


def _first_rows(array: np.ndarray, count: int, rows: int) -> np.ndarray:
    """The first `rows` of `count` output rows, stored (count, ...) or flattened (count * n,)."""
    if array.ndim == 1:
        return array.reshape(count, -1)[:rows].reshape(-1)
    return array[:rows]


def _replace(initializer: object, array: np.ndarray) -> None:
    """Overwrites an initializer's data with `array`, keeping its name."""
    from onnx import numpy_helper

    initializer.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(array), initializer.name))
