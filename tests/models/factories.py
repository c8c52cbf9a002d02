"""A user-style model factory for tests (`package.module:factory`)."""

import math

from torch import nn


def tiny_linear(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 8), nn.ReLU(), nn.Linear(8, num_classes))
