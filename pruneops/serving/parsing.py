"""A request's body as a batch for the served model: numbers, images or texts, checked; feedback labels."""

from __future__ import annotations

from typing import Annotated

import numpy as np
from fastapi import HTTPException
from pydantic import BaseModel, Field

from pruneops.modelstore.store import ServableModel


class PredictRequest(BaseModel):
    """A batch: `inputs` (nested lists of the model's input shape), `images` or `texts`.

    `images` are base64 PNG/JPEG; `texts` are for a text model, tokenised here by its own tokenizer.
    """

    inputs: list | None = None
    images: list[Annotated[str, Field(max_length=16 * 1024 * 1024)]] | None = None
    texts: list[str] | None = None


def parse_inputs(body: PredictRequest, model: ServableModel, max_batch: int) -> np.ndarray | dict[str, np.ndarray]:
    """The request as a batch: float32 of the model's input shape, or a text model's named feed.

    Raises:
        HTTPException: 422 naming what is wrong (shape, batch size, non-finite values, an image, a text).
    """
    given = [k for k in ("inputs", "images", "texts") if getattr(body, k) is not None]
    if model.encoder is not None:
        if given != ["texts"]:
            raise HTTPException(422, 'this is a text model: send {"texts": ["...", ...]}')
        return _parse_texts(body.texts, model, max_batch)
    if len(given) != 1 or given == ["texts"]:
        raise HTTPException(422, "send exactly one of inputs (numbers) or images (base64 PNG/JPEG)")
    if body.images is not None:
        return _parse_images(body.images, model, max_batch)
    return _parse_numbers(body.inputs, model, max_batch)


def _parse_numbers(inputs: list, model: ServableModel, max_batch: int) -> np.ndarray:
    if len(inputs) > max_batch:
        raise HTTPException(422, f"batch size must be 1..{max_batch}, got {len(inputs)}")
    deepest = len(model.input_shape) + 1  # a batch of inputs
    if _nesting_depth(inputs, deepest) > deepest:
        raise HTTPException(422, f"inputs are nested deeper than a batch of {list(model.input_shape)} arrays")
    try:
        raw = np.asarray(inputs, dtype=object)
        # Only numbers: JSON true/false (or text) would otherwise be read as 1/0 without a word.
        if not set(map(type, raw.flat)) <= {int, float}:
            raise TypeError
        x = raw.astype(np.float32)
    except (ValueError, TypeError, OverflowError, RuntimeError, RecursionError):
        raise HTTPException(422, "inputs must be a (nested) list of numbers with a regular shape") from None
    if x.ndim == len(model.input_shape):
        x = x[None]
    if x.shape[1:] != model.input_shape:
        raise HTTPException(422, f"each input must have shape {list(model.input_shape)}, got {list(x.shape[1:])}")
    if not 1 <= len(x) <= max_batch:
        raise HTTPException(422, f"batch size must be 1..{max_batch}, got {len(x)}")
    if not np.isfinite(x).all():
        raise HTTPException(422, "inputs must be finite (no NaN or infinity)")
    return x


def _nesting_depth(value: object, limit: int) -> int:
    """How deep lists nest in `value`, counted up to `limit` + 1 (deeper levels are not looked at)."""
    depth, level = 0, [value]
    while depth <= limit:
        lists = [v for v in level if isinstance(v, list)]
        if not lists:
            return depth
        depth += 1
        level = [item for v in lists for item in v]
    return depth


def _parse_texts(texts: list[str], model: ServableModel, max_batch: int) -> dict[str, np.ndarray]:
    from pruneops.serving.text import TextInputError

    if not 1 <= len(texts) <= max_batch:
        raise HTTPException(422, f"batch size must be 1..{max_batch}, got {len(texts)}")
    try:
        return model.encoder.encode(texts)
    except TextInputError as exc:
        raise HTTPException(422, str(exc)) from None


def _parse_images(images: list[str], model: ServableModel, max_batch: int) -> np.ndarray:
    from pruneops.serving.images import ImageInputError, decode_images

    if not 1 <= len(images) <= max_batch:
        raise HTTPException(422, f"batch size must be 1..{max_batch}, got {len(images)}")
    try:
        return decode_images(images, model.input_shape, model.metadata.get("input", {}).get("value_range"))
    except ImageInputError as exc:
        raise HTTPException(422, str(exc)) from None


def feedback_label(label: int | str, model: ServableModel | None) -> int:
    """The class index of a feedback label given as an index or as a class name.

    Raises:
        HTTPException: 422 for a label that is not a class of the served model.
    """
    names = (model.metadata.get("input", {}).get("class_names") if model else None) or []
    if isinstance(label, str):
        if label not in names:
            known = f"one of {names}" if names else "a class index (this model has no class names)"
            raise HTTPException(422, f"label {label!r} is not a class of the served model: send {known}")
        return names.index(label)
    classes = model.num_classes if model is not None else None
    if classes is not None and not 0 <= label < classes:
        raise HTTPException(422, f"label must be a class of the served model: 0..{classes - 1}, got {label}")
    return label
