"""Built-in architectures: `mlp`, `cnn` (residual, BatchNorm) and `transformer`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pruneops.core.errors import ConfigError
from pruneops.models.registry import MODELS


def _ints(name: str, values: object, low: int, high: int, count: tuple[int, int] = (1, 1)) -> tuple[int, ...]:
    """Checks a model_kwargs entry (an int or a list of ints) against its bounds.

    Raises:
        ConfigError: Not integers, too many or too few, or out of range.
    """
    items = values if isinstance(values, (list, tuple)) else [values]
    ok = count[0] <= len(items) <= count[1] and all(isinstance(v, int) and not isinstance(v, bool) for v in items)
    if not ok or not all(low <= v <= high for v in items):
        many = f"{count[0]}..{count[1]} integers" if count != (1, 1) else "an integer"
        raise ConfigError(f"train.model_kwargs.{name}: must be {many} in {low}..{high} (got {values!r})")
    return tuple(items)


def _dropout(value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0.0 <= value < 1.0:
        raise ConfigError(f"train.model_kwargs.dropout: must be a number in [0, 1) (got {value!r})")
    return float(value)


class MLP(nn.Module):
    """Fully connected classifier over flattened inputs."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...], dropout: float):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(dropout)]
            width = h
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


@MODELS.register("mlp", "fully connected network over flattened inputs")
def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: list[int] | None = None, dropout: float = 0.1) -> MLP:
    """Builds an MLP; `hidden` lists the hidden widths (default 512, 512)."""
    widths = _ints("hidden", hidden if hidden is not None else [512, 512], 1, 65_536, (1, 64))
    return MLP(input_shape, num_classes, widths, _dropout(dropout))


class BasicBlock(nn.Module):
    """Two 3x3 conv/BN layers with an identity or 1x1 projection shortcut."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResidualCNN(nn.Module):
    """A small ResNet: stem, stages of basic blocks (stride 2 between stages), pooled head."""

    def __init__(self, in_channels: int, num_classes: int, widths: tuple[int, ...], blocks: int):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()
        )
        stages: list[nn.Module] = []
        cin = widths[0]
        for i, w in enumerate(widths):
            for b in range(blocks):
                stages.append(BasicBlock(cin, w, 2 if (i > 0 and b == 0) else 1))
                cin = w
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


@MODELS.register("cnn", "residual CNN with BatchNorm (ResNet basic blocks)")
def cnn(
    input_shape: tuple[int, ...], num_classes: int, widths: list[int] | None = None, blocks: int = 1
) -> ResidualCNN:
    """Builds a residual CNN over (C, H, W) images; `widths` per stage (default 64, 128)."""
    if len(input_shape) != 3:
        raise ConfigError(f"train.model: cnn needs image inputs (C, H, W), data has shape {list(input_shape)}")
    stages = _ints("widths", widths if widths is not None else [64, 128], 1, 4096, (1, 8))
    return ResidualCNN(input_shape[0], num_classes, stages, _ints("blocks", blocks, 1, 16)[0])


class MultiHeadSelfAttention(nn.Module):
    """Self-attention with separate Q/K/V/output projections, so heads can be removed.

    Attributes:
        num_heads: Current number of heads (decreases when heads are pruned).
        head_dim: Width of one head.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        inner = num_heads * head_dim
        self.q = nn.Linear(dim, inner)
        self.k = nn.Linear(dim, inner)
        self.v = nn.Linear(dim, inner)
        self.out = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        shape = (b, t, self.num_heads, self.head_dim)
        q = self.q(x).reshape(shape).transpose(1, 2)
        k = self.k(x).reshape(shape).transpose(1, 2)
        v = self.v(x).reshape(shape).transpose(1, 2)
        attn = torch.softmax(q @ k.transpose(-2, -1) * self.head_dim**-0.5, dim=-1)
        ctx = attn @ v
        return self.out(ctx.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))

    def extra_macs(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> int:
        """MACs of the two attention matmuls (the projections are counted as Linears)."""
        b, t, _ = inputs[0].shape
        return 2 * b * self.num_heads * t * t * self.head_dim


class EncoderLayer(nn.Module):
    """Pre-norm transformer encoder layer."""

    def __init__(self, dim: int, num_heads: int, head_dim: int, ffn_dim: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = MultiHeadSelfAttention(dim, num_heads, head_dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(), nn.Linear(ffn_dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.ffn(self.norm2(x)))


class TokenTransformer(nn.Module):
    """Encoder classifier over tokens: image rows (C*W features each) or single table features."""

    def __init__(
        self,
        input_shape: tuple[int, ...],
        num_classes: int,
        dim: int,
        depth: int,
        num_heads: int,
        head_dim: int,
        ffn_dim: int,
        dropout: float,
    ):
        super().__init__()
        if len(input_shape) == 3:
            c, h, w = input_shape
            self.tokens, self.token_dim = h, c * w
        else:
            self.tokens, self.token_dim = math.prod(input_shape), 1
        self.embed = nn.Linear(self.token_dim, dim)
        self.pos = nn.Parameter(torch.zeros(1, self.tokens, dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.layers = nn.Sequential(*[EncoderLayer(dim, num_heads, head_dim, ffn_dim, dropout) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.classifier = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4:  # (B, C, H, W) -> rows as tokens (B, H, C*W)
            x = x.permute(0, 2, 1, 3).reshape(x.shape[0], self.tokens, self.token_dim)
        else:
            x = x.reshape(x.shape[0], self.tokens, self.token_dim)
        x = self.layers(self.embed(x) + self.pos)
        return self.classifier(self.norm(x).mean(dim=1))


@MODELS.register("transformer", "encoder classifier over token sequences (image rows as tokens)")
def transformer(
    input_shape: tuple[int, ...],
    num_classes: int,
    dim: int = 64,
    depth: int = 2,
    num_heads: int = 4,
    head_dim: int | None = None,
    ffn_dim: int = 128,
    dropout: float = 0.1,
) -> TokenTransformer:
    """Builds the token transformer (defaults: dim 64, 2 layers, 4 heads, FFN 128)."""
    (dim,), (depth,), (heads,), (ffn,) = (
        _ints("dim", dim, 1, 8192),
        _ints("depth", depth, 1, 64),
        _ints("num_heads", num_heads, 1, 256),
        _ints("ffn_dim", ffn_dim, 1, 65_536),
    )
    width = _ints("head_dim", head_dim, 1, 8192)[0] if head_dim is not None else dim // heads
    if width < 1:
        raise ConfigError(f"train.model_kwargs: num_heads {heads} leaves no width per head at dim {dim}")
    return TokenTransformer(input_shape, num_classes, dim, depth, heads, width, ffn, _dropout(dropout))
