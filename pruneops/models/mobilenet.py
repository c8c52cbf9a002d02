"""`mobilenet_v2`: torchvision's MobileNetV2 with torchvision's module names.

Users bring ImageNet weights saved from `torchvision.models.mobilenet_v2` (a state dict keyed
`features.N...`, `classifier.1...`). torchvision itself cannot be imported beside the CPU torch
here (the build served for torch 2.13 is a CUDA one: `operator torchvision::nms does not exist`),
so the architecture is written out with the same module tree, and those files load strictly.
Where torchvision imports, `train.model: torchvision.models:mobilenet_v2` works as a user factory
as well (`create_model` passes `input_shape` only to factories that name it).
"""

from __future__ import annotations

import torch
from torch import nn

from pruneops.core.errors import ConfigError
from pruneops.models.registry import MODELS

# (expansion t, output channels c, repeats n, first stride s): Sandler et al. 2018, Table 2.
INVERTED_RESIDUAL_SETTING = [
    [1, 16, 1, 1],
    [6, 24, 2, 2],
    [6, 32, 3, 2],
    [6, 64, 4, 2],
    [6, 96, 3, 1],
    [6, 160, 3, 2],
    [6, 320, 1, 1],
]


def make_divisible(value: float, divisor: int = 8) -> int:
    """Channel rounding as torchvision does it: the nearest multiple of `divisor`, never below 90% of `value`."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


class ConvBNReLU(nn.Sequential):
    """Conv (no bias), BatchNorm, ReLU6: torchvision's `Conv2dNormActivation` layout (indices 0, 1, 2)."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1) -> None:
        super().__init__(
            nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    """Expand (1x1), depthwise (3x3), project (1x1, linear); a skip when shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = round(cin * expand_ratio)
        self.use_res_connect = stride == 1 and cin == cout
        layers: list[nn.Module] = [ConvBNReLU(cin, hidden, kernel=1)] if expand_ratio != 1 else []
        layers += [
            ConvBNReLU(hidden, hidden, stride=stride, groups=hidden),
            nn.Conv2d(hidden, cout, 1, 1, 0, bias=False),
            nn.BatchNorm2d(cout),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2 (features, global average pool, dropout + Linear classifier)."""

    def __init__(self, in_channels: int, num_classes: int, width_mult: float = 1.0, dropout: float = 0.2) -> None:
        super().__init__()
        channels = make_divisible(32 * width_mult)
        self.last_channel = make_divisible(1280 * max(1.0, width_mult))
        features: list[nn.Module] = [ConvBNReLU(in_channels, channels, stride=2)]
        for t, c, n, s in INVERTED_RESIDUAL_SETTING:
            out = make_divisible(c * width_mult)
            for i in range(n):
                features.append(InvertedResidual(channels, out, s if i == 0 else 1, t))
                channels = out
        features.append(ConvBNReLU(channels, self.last_channel, kernel=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(dropout), nn.Linear(self.last_channel, num_classes))
        self._init_weights()

    def _init_weights(self) -> None:
        # torchvision's initialisation, so that training from scratch compares like for like.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = nn.functional.adaptive_avg_pool2d(self.features(x), 1)
        return self.classifier(torch.flatten(x, 1))


@MODELS.register("mobilenet_v2", "torchvision's MobileNetV2 (same module names: its ImageNet weights load strictly)")
def mobilenet_v2(
    input_shape: tuple[int, ...], num_classes: int, width_mult: float = 1.0, dropout: float = 0.2
) -> MobileNetV2:
    """MobileNetV2 over (C, H, W) images; ImageNet weights need C = 3 (`validate.channels: 3`)."""
    if len(input_shape) != 3:
        raise ConfigError(f"train.model: mobilenet_v2 needs image inputs (C, H, W), data has shape {list(input_shape)}")
    if isinstance(width_mult, bool) or not isinstance(width_mult, (int, float)) or not 0.1 <= width_mult <= 4.0:
        raise ConfigError(f"train.model_kwargs.width_mult: must be a number in 0.1..4 (got {width_mult!r})")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ConfigError(f"train.model_kwargs.dropout: must be a number in [0, 1) (got {dropout!r})")
    return MobileNetV2(input_shape[0], num_classes, float(width_mult), float(dropout))
