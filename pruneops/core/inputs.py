"""Named model inputs: what a model takes, described once and read by export, timing and serving.

An image model takes one float tensor per sample (`input`, shape C×H×W); a text encoder takes
token ids and an attention mask (int64, one symbolic `seq` axis). The ONNX input names, dtypes and
dynamic axes come from these specs, so a token-id model exports with int64 ids and a dynamic
sequence length instead of a float example.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

# The single input of image models keeps the name every exported model had before named inputs.
IMAGE_INPUT = "input"
DTYPES = ("float32", "int64")


@dataclass(frozen=True)
class InputSpec:
    """One named input: dtype and per-sample shape; a str dim is symbolic (e.g. "seq").

    Attributes:
        name: The ONNX input name and the model's keyword.
        dtype: "float32" or "int64".
        shape: Per-sample shape, without the batch axis.
    """

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"input {self.name!r}: dtype {self.dtype!r} is not one of {DTYPES}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form, as saved in checkpoint and model-card metadata."""
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> InputSpec:
        """Inverse of `to_dict`."""
        return cls(str(data["name"]), str(data["dtype"]), tuple(data["shape"]))


def image_inputs(shape: Sequence[int]) -> tuple[InputSpec, ...]:
    """The one float input of an image (or table) model with per-sample `shape`."""
    return (InputSpec(IMAGE_INPUT, "float32", tuple(int(d) for d in shape)),)


def text_inputs(token_type_ids: bool = False) -> tuple[InputSpec, ...]:
    """Token ids and attention mask (and segment ids if the model uses them), each of length `seq`."""
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if token_type_ids else [])
    return tuple(InputSpec(n, "int64", ("seq",)) for n in names)


def as_specs(inputs: Sequence[int] | Sequence[InputSpec]) -> tuple[InputSpec, ...]:
    """Specs as given, or the image spec of a plain per-sample shape (the pre-named-inputs form)."""
    items = list(inputs)
    if items and all(isinstance(i, InputSpec) for i in items):
        return tuple(items)
    if all(isinstance(i, int) for i in items):
        return image_inputs(items)
    raise TypeError(f"inputs must be a shape or InputSpecs, got {inputs!r}")


def concrete_shape(spec: InputSpec, batch: int, sizes: Mapping[str, int]) -> tuple[int, ...]:
    """The full shape of a batch: symbolic dims taken from `sizes`.

    Raises:
        KeyError: A symbolic dim has no size.
    """
    return (batch, *(sizes[d] if isinstance(d, str) else d for d in spec.shape))


def example_arrays(
    specs: Sequence[InputSpec], batch: int, sizes: Mapping[str, int] | None = None
) -> dict[str, np.ndarray]:
    """A batch to export or time with: zeros for floats, token id 1 and a full attention mask."""
    sizes = {"seq": 16, **(sizes or {})}
    out: dict[str, np.ndarray] = {}
    for spec in specs:
        shape = concrete_shape(spec, batch, sizes)
        if spec.dtype == "float32":
            out[spec.name] = np.zeros(shape, dtype=np.float32)
        elif spec.name == "token_type_ids":
            out[spec.name] = np.zeros(shape, dtype=np.int64)
        else:
            out[spec.name] = np.ones(shape, dtype=np.int64)
    return out


def example_tensors(
    specs: Sequence[InputSpec], batch: int, sizes: Mapping[str, int] | None = None
) -> dict[str, torch.Tensor]:
    """`example_arrays` as torch tensors."""
    import torch

    return {k: torch.from_numpy(v) for k, v in example_arrays(specs, batch, sizes).items()}


def dynamic_axes(specs: Sequence[InputSpec]) -> dict[str, dict[int, str]]:
    """Per input, its dynamic axes for ONNX: the batch and every symbolic dim."""
    return {s.name: {0: "batch", **{i + 1: d for i, d in enumerate(s.shape) if isinstance(d, str)}} for s in specs}


def as_tensors(x: np.ndarray | Mapping[str, np.ndarray]) -> torch.Tensor | dict[str, torch.Tensor]:
    """NumPy inputs (plain or named) as torch tensors sharing their memory."""
    import torch

    if isinstance(x, Mapping):
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in x.items()}
    return torch.from_numpy(x)


def rows(x, index):
    """Rows `index` (slice or index array) of plain or named inputs, NumPy or torch."""
    return {k: v[index] for k, v in x.items()} if isinstance(x, Mapping) else x[index]


def count_rows(x) -> int:
    """Number of samples in plain or named inputs."""
    return len(next(iter(x.values()))) if isinstance(x, Mapping) else len(x)


def run_model(model, x):
    """`model(**x)` for named inputs, `model(x)` for one tensor."""
    return model(**x) if isinstance(x, Mapping) else model(x)


def model_inputs(model) -> tuple[InputSpec, ...]:
    """The named inputs `create_model` recorded on `model`, else its one float input."""
    specs = getattr(model, "_pruneops_inputs", None)
    if specs:
        return tuple(specs)
    return image_inputs(model._pruneops_input_shape)


def example_input(model, input_shape: Sequence[int] | None = None, batch: int = 1):
    """A batch to trace or profile `model` with.

    Zeros of `input_shape` for one float input, or the named example of the model's `InputSpec`s
    (ids 1, full mask, `seq` = `input_shape[0]`).
    """
    import torch

    specs = getattr(model, "_pruneops_inputs", None)
    if not specs:
        shape = input_shape if input_shape is not None else model._pruneops_input_shape
        return torch.zeros(batch, *shape)
    seq = {"seq": int(input_shape[0])} if input_shape else None
    return example_tensors(specs, batch, seq)


def trim_padding(x):
    """Named inputs cut to the longest attention mask in the batch; anything else as it is.

    Texts are padded to the data's `max_length`; a batch of short texts then pays for padding
    it masks out. For encoders with an attention mask the logits are the same either way.
    """
    if not isinstance(x, Mapping) or "attention_mask" not in x:
        return x
    mask = x["attention_mask"]
    longest = int(mask.sum(-1).max()) if mask.numel() else 0
    if longest >= mask.shape[-1] or longest == 0:
        return x
    return {k: v[..., :longest] if v.ndim >= 2 and v.shape[-1] == mask.shape[-1] else v for k, v in x.items()}


def length_order(x) -> torch.Tensor | None:
    """Sample indices by attention-mask length, shortest first (stable); None for inputs without a mask."""
    import torch

    if not isinstance(x, Mapping) or "attention_mask" not in x:
        return None
    return torch.argsort(torch.as_tensor(x["attention_mask"]).sum(-1), stable=True)


def head_tensors(x, n: int = 1):
    """The first `n` samples of NumPy inputs (plain or named) as torch tensors: an example batch."""
    return as_tensors(rows(x, slice(0, n)))


def as_feed(x) -> dict[str, np.ndarray]:
    """An ONNX Runtime feed: named inputs as they are, one array as the image input."""
    if isinstance(x, Mapping):
        return {k: np.ascontiguousarray(v) for k, v in x.items()}
    return {IMAGE_INPUT: np.ascontiguousarray(x)}


def timing_inputs(model, input_shape: Sequence[int], batch: int) -> np.ndarray | dict[str, np.ndarray]:
    """Inputs to time `model` with.

    Uniform noise of `input_shape`, or the named example at `seq` = `input_shape[0]` (every token
    real: the cost of a text of the data's `max_length`).
    """
    specs = getattr(model, "_pruneops_inputs", None)
    if specs:
        return example_arrays(specs, batch, {"seq": int(input_shape[0])})
    return np.random.default_rng(0).random((batch, *input_shape), dtype=np.float32)


def unknown_id(tokenizer) -> int | None:
    """The id of a `tokenizers.Tokenizer`'s unknown token (None when its model has none)."""
    token = getattr(tokenizer.model, "unk_token", None)
    return None if token is None else tokenizer.token_to_id(token)


def pad_id(tokenizer) -> int:
    """The id `encode_texts` pads with: the tokenizer's padding id, else 0."""
    return tokenizer.padding["pad_id"] if tokenizer.padding else 0


def encode_texts(
    tokenizer, texts: list[str], max_length: int, names: Sequence[str] = ("input_ids", "attention_mask")
) -> dict[str, np.ndarray]:
    """Texts as named int64 arrays, truncated and padded to `max_length`.

    `names` picks among `input_ids`, `attention_mask` and `token_type_ids`: what `validate` stores
    and serving feeds come from this one piece of code.
    """
    tokenizer.enable_truncation(max_length)
    tokenizer.enable_padding(length=max_length, pad_id=pad_id(tokenizer))
    encodings = tokenizer.encode_batch(texts)
    fields = {"input_ids": "ids", "attention_mask": "attention_mask", "token_type_ids": "type_ids"}
    return {n: np.array([getattr(e, fields[n]) for e in encodings], dtype=np.int64) for n in names}
