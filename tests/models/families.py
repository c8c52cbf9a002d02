"""Architecture families users bring, written here from scratch, given by import path like a user's own.

`train.model: tests.models.families:<name>`; each takes `(input_shape, num_classes, width=...)`.

- `mobilenet_v2_style`: depthwise convs, inverted residuals (ReLU6, linear bottleneck) and one
  block whose output is a channel concat of two projections;
- `se_net`: conv blocks with squeeze-and-excitation, the classifier registered *before* the
  blocks (so "the last registered Linear" is an SE layer, not the head);
- `resnet18_style`: basic blocks [2, 2, 2, 2] with projection shortcuts;
- `vit_style`: a patch embedding, a class token, and encoder layers whose attention has one fused
  `qkv` projection (timm's layout);
- `convnext_style`: ConvNeXt blocks (7x7 depthwise conv, LayerNorm over channels-last, an inverted
  MLP of Linears with GELU, a learned per-channel layer scale held as a bare `nn.Parameter`),
  and channels-first LayerNorms (a module of its own, as in ConvNeXt's code) before each downsample.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def _bn_act(cin: int, cout: int, k: int = 3, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    if act:
        layers.append(nn.ReLU6(inplace=True))
    return nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """Expand 1x1, depthwise 3x3, linear projection 1x1; residual when shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.expand = _bn_act(cin, hidden, 1)
        self.depthwise = _bn_act(hidden, hidden, 3, stride, groups=hidden)
        self.project = _bn_act(hidden, cout, 1, act=False)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(self.depthwise(self.expand(x)))
        return x + out if self.residual else out


class ConcatBlock(nn.Module):
    """Two projections of one depthwise stage, concatenated along channels."""

    def __init__(self, cin: int, cout: int, expand: int):
        super().__init__()
        hidden = cin * expand
        self.expand = _bn_act(cin, hidden, 1)
        self.depthwise = _bn_act(hidden, hidden, 3, groups=hidden)
        self.left = _bn_act(hidden, cout // 2, 1, act=False)
        self.right = _bn_act(hidden, cout - cout // 2, 1, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.depthwise(self.expand(x))
        return torch.cat([self.left(h), self.right(h)], dim=1)


class MobileNetV2Style(nn.Module):
    """A small MobileNetV2: stem, inverted residuals (one concat block), 1x1 head conv, pooled classifier."""

    def __init__(self, in_channels: int, num_classes: int, width: int):
        super().__init__()
        w = width
        self.stem = _bn_act(in_channels, w, 3, 1)
        self.blocks = nn.Sequential(
            InvertedResidual(w, w, 1, 1),
            InvertedResidual(w, int(1.5 * w), 2, 4),
            InvertedResidual(int(1.5 * w), int(1.5 * w), 1, 4),
            ConcatBlock(int(1.5 * w), 2 * w, 4),
            InvertedResidual(2 * w, 2 * w, 1, 4),
            InvertedResidual(2 * w, 4 * w, 2, 4),
        )
        self.head = _bn_act(4 * w, 8 * w, 1)
        self.classifier = nn.Linear(8 * w, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.blocks(self.stem(x)))
        return self.classifier(F.adaptive_avg_pool2d(x, 1).flatten(1))


def mobilenet_v2_style(input_shape, num_classes, width: int = 16) -> MobileNetV2Style:
    """MobileNetV2-style family."""
    return MobileNetV2Style(input_shape[0], num_classes, width)


class SqueezeExcite(nn.Module):
    """Channel attention: global pool, reduce, expand, sigmoid gate."""

    def __init__(self, channels: int, reduction: int = 4):
        super().__init__()
        self.reduce = nn.Linear(channels, max(channels // reduction, 4))
        self.expand = nn.Linear(max(channels // reduction, 4), channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.sigmoid(self.expand(F.relu(self.reduce(x.mean((2, 3))))))
        return x * s[:, :, None, None]


class SEBlock(nn.Module):
    """Conv-BN-ReLU twice, then squeeze-and-excitation, with a (projected) residual."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())
        self.conv2 = nn.Sequential(nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout))
        self.se = SqueezeExcite(cout)
        self.short = (
            nn.Identity()
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.se(self.conv2(self.conv1(x))) + self.short(x))


class SENet(nn.Module):
    """Stem and SE blocks; the head (`fc`) is registered first, before any SE Linear."""

    def __init__(self, in_channels: int, num_classes: int, width: int):
        super().__init__()
        self.fc = nn.Linear(4 * width, num_classes)
        self.stem = nn.Sequential(nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.blocks = nn.Sequential(SEBlock(width, 2 * width, 1), SEBlock(2 * width, 4 * width, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))


def se_net(input_shape, num_classes, width: int = 16) -> SENet:
    """Squeeze-and-excitation family."""
    return SENet(input_shape[0], num_classes, width)


class BasicBlock(nn.Module):
    """ResNet basic block."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + identity)


class ResNet18Style(nn.Module):
    """ResNet-18's layout ([2, 2, 2, 2] basic blocks) at a smaller width, for small images."""

    def __init__(self, in_channels: int, num_classes: int, width: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        layers, cin = [], width
        for i, mult in enumerate((1, 2, 4, 8)):
            cout = width * mult
            layers.append(nn.Sequential(BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def resnet18_style(input_shape, num_classes, width: int = 8) -> ResNet18Style:
    """ResNet-18-style family."""
    return ResNet18Style(input_shape[0], num_classes, width)


class FusedAttention(nn.Module):
    """timm-style attention: one `qkv` Linear (3 x heads x head_dim rows) and an output `proj`."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * num_heads * self.head_dim)
        self.proj = nn.Linear(num_heads * self.head_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x).reshape(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        attn = torch.softmax(q @ k.transpose(-2, -1) * self.head_dim**-0.5, dim=-1)
        return self.proj((attn @ v).transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class ViTBlock(nn.Module):
    """Pre-norm encoder block with an MLP."""

    def __init__(self, dim: int, num_heads: int, mlp: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = FusedAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp), nn.GELU(), nn.Linear(mlp, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViTStyle(nn.Module):
    """Patch embedding (a strided conv), class token, positions, encoder blocks, head on the class token."""

    def __init__(self, input_shape, num_classes: int, dim: int, depth: int, num_heads: int, patch: int):
        super().__init__()
        c, h, w = input_shape
        self.patch_embed = nn.Conv2d(c, dim, patch, patch)
        tokens = (h // patch) * (w // patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[ViTBlock(dim, num_heads, 2 * dim) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


def vit_style(input_shape, num_classes, dim: int = 32, depth: int = 2, num_heads: int = 4, patch: int = 2) -> ViTStyle:
    """ViT-style patch transformer with fused-qkv attention."""
    return ViTStyle(input_shape, num_classes, dim, depth, num_heads, patch)


class LayerNorm2d(nn.Module):
    """LayerNorm over the channels of an NCHW tensor, written out as ConvNeXt's reference code does."""

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(1, keepdim=True)
        var = (x - mean).pow(2).mean(1, keepdim=True)
        x = (x - mean) / torch.sqrt(var + self.eps)
        return self.weight[:, None, None] * x + self.bias[:, None, None]


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7, LayerNorm and a 4x MLP in channels-last, a layer scale, a residual add."""

    def __init__(self, dim: int, layer_scale: float):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), layer_scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        y = self.gamma * self.pwconv2(F.gelu(self.pwconv1(y)))
        return x + y.permute(0, 3, 1, 2)


class ConvNeXtStyle(nn.Module):
    """A patchify stem, two stages of ConvNeXt blocks with a downsample between, a normed head."""

    def __init__(self, input_shape, num_classes: int, width: int, depths: Sequence[int], layer_scale: float):
        super().__init__()
        c = input_shape[0]
        self.stem = nn.Sequential(nn.Conv2d(c, width, 2, 2), LayerNorm2d(width))
        self.stage1 = nn.Sequential(*[ConvNeXtBlock(width, layer_scale) for _ in range(depths[0])])
        self.down = nn.Sequential(LayerNorm2d(width), nn.Conv2d(width, 2 * width, 2, 2))
        self.stage2 = nn.Sequential(*[ConvNeXtBlock(2 * width, layer_scale) for _ in range(depths[1])])
        self.norm = nn.LayerNorm(2 * width, eps=1e-6)
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.head(self.norm(x.mean((2, 3))))


def convnext_style(
    input_shape, num_classes, width: int = 32, depths: Sequence[int] = (1, 1), layer_scale: float = 0.1
) -> ConvNeXtStyle:
    """ConvNeXt-style: depthwise 7x7, channels-last LayerNorm, inverted MLP, layer scale.

    `layer_scale` starts at 0.1, not ConvNeXt's 1e-6: that suits 300 epochs, and these models
    train for a few.
    """
    return ConvNeXtStyle(input_shape, num_classes, width, depths, layer_scale)


FAMILIES = {
    "mobilenet_v2_style": {},
    "se_net": {},
    "resnet18_style": {},
    "vit_style": {},
    "convnext_style": {},
}
