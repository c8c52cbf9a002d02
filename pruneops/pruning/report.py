"""`sparsity_report`: per layer and global zeros, params, MACs and shrink of each dimension."""

from __future__ import annotations

from torch import nn

from pruneops.models.profiling import count_nonzero_params, count_params, layer_macs

WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d)


def layer_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Weight shape of every Linear/Conv layer, by name (the reference for shrink ratios)."""
    return {n: list(m.weight.shape) for n, m in model.named_modules() if isinstance(m, WEIGHTED)}


def sparsity_report(model: nn.Module, input_shape: list[int], reference: dict[str, list[int]] | None = None) -> dict:
    """Describes how sparse and how small `model` is.

    Args:
        model: The model.
        input_shape: Shape of one input sample (for MACs).
        reference: `layer_shapes` of the unpruned model; adds per-dimension shrink factors and
            the global parameter/MAC reductions of structured pruning.

    Returns:
        `{"global": {...}, "layers": {name: {...}}}`. `zero_fraction` counts exact zeros in
        weights (unstructured sparsity: no speed-up through dense kernels); `macs` is the dense
        work, `nonzero_macs` what a sparse kernel would do.
    """
    dense = layer_macs(model, input_shape)
    nonzero = layer_macs(model, input_shape, nonzero=True)
    layers: dict[str, dict] = {}
    weights = zeros = 0
    for name, m in model.named_modules():
        if not isinstance(m, WEIGHTED):
            continue
        w = m.weight
        z = int((w == 0).sum())
        weights += w.numel()
        zeros += z
        row = {
            "type": type(m).__name__,
            "shape": list(w.shape),
            "params": sum(p.numel() for p in m.parameters(recurse=False)),
            "zero_fraction": z / w.numel(),
            "macs": dense.get(name, 0),
            "nonzero_macs": nonzero.get(name, 0),
        }
        if reference and name in reference:
            row["shrink"] = [cur / ref for cur, ref in zip(w.shape, reference[name], strict=True)]
        layers[name] = row
    total = {
        "params": count_params(model),
        "nonzero_params": count_nonzero_params(model),
        "weight_zero_fraction": zeros / max(weights, 1),
        "macs": sum(dense.values()),
        "nonzero_macs": sum(nonzero.values()),
    }
    return {"global": total, "layers": layers}
