"""Raw images (base64 PNG/JPEG) to the model's input, as `validate` prepared the training data.

Decoded with Pillow, converted to the model's channel count (L or RGB), resized to the data's
height and width if they differ, then scaled from the data's value range to [0, 1] exactly as
`validate` scaled the training images. Whatever `train.preprocess` declared (resize to the
network's size, grayscale to 3 channels, mean/std) runs inside the model after that.
"""

from __future__ import annotations

import base64
import binascii
import io

import numpy as np

MAX_IMAGE_PIXELS = 4096 * 4096


class ImageInputError(ValueError):
    """An image that cannot be turned into a model input (the message says why)."""


def decode_images(encoded: list[str], input_shape: tuple[int, ...], value_range: list[float] | None) -> np.ndarray:
    """A float32 batch of the model's input shape from base64-encoded PNG/JPEG images.

    Raises:
        ImageInputError: Not base64, not an image, too large, a model that does not take images,
            or a model version without the data's value range.
    """
    from PIL import Image, UnidentifiedImageError

    if len(input_shape) != 3 or input_shape[0] not in (1, 3):
        raise ImageInputError(f"this model takes inputs of shape {list(input_shape)}, not images; send inputs")
    if value_range is None:
        raise ImageInputError("this model version does not record its data's value range; send inputs")
    channels, height, width = input_shape
    low, high = value_range
    batch = []
    for i, text in enumerate(encoded):
        try:
            data = base64.b64decode(text, validate=True)
            with Image.open(io.BytesIO(data)) as img:
                if img.width * img.height > MAX_IMAGE_PIXELS:
                    raise ImageInputError(
                        f"images[{i}]: {img.width}x{img.height} is larger than {MAX_IMAGE_PIXELS} pixels"
                    )
                img = img.convert("L" if channels == 1 else "RGB")
                if img.size != (width, height):
                    img = img.resize((width, height), Image.Resampling.BILINEAR)
                pixels = np.asarray(img, dtype=np.float32)
        except (binascii.Error, ValueError) as exc:
            if isinstance(exc, ImageInputError):
                raise
            raise ImageInputError(f"images[{i}]: not base64 ({exc})") from None
        except Image.DecompressionBombError:  # Pillow refuses huge headers itself, before our own bound
            raise ImageInputError(f"images[{i}]: larger than {MAX_IMAGE_PIXELS} pixels") from None
        except (UnidentifiedImageError, OSError, SyntaxError) as exc:
            raise ImageInputError(f"images[{i}]: not a readable PNG/JPEG image ({type(exc).__name__})") from None
        pixels = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
        batch.append((pixels - low) / (high - low))
    return np.stack(batch).astype(np.float32)
