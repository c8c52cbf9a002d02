import pytest
import torch

from pruneops.core.errors import ConfigError
from pruneops.models import ModelSpec, classifier_of, create_model
from pruneops.models.profiling import count_macs, count_params


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("batch", [1, 5])
def test_builtin_models_run_forward(name, batch):
    model = create_model(ModelSpec(name, [1, 8, 8], 10)).eval()
    assert model(torch.randn(batch, 1, 8, 8)).shape == (batch, 10)
    assert classifier_of(model).out_features == 10


def test_mlp_macs_are_exact():
    model = create_model(ModelSpec("mlp", [1, 8, 8], 10, {"hidden": [32, 16]}))
    assert count_macs(model, [1, 8, 8]) == 64 * 32 + 32 * 16 + 16 * 10
    assert count_params(model) == (64 * 32 + 32) + (32 * 16 + 16) + (16 * 10 + 10)


def test_transformer_macs_include_attention_matmuls():
    model = create_model(
        ModelSpec("transformer", [1, 8, 8], 10, {"dim": 16, "depth": 1, "num_heads": 2, "ffn_dim": 32})
    )
    t, d = 8, 16
    linear = t * (8 * d) + 4 * t * d * d + t * (d * 32 + 32 * d) + d * 10
    attention = 2 * 2 * t * t * (d // 2)
    assert count_macs(model, [1, 8, 8]) == linear + attention


def test_user_factory_and_bad_names():
    model = create_model(ModelSpec("tests.models.factories:tiny_linear", [4], 3))
    assert model(torch.randn(2, 4)).shape == (2, 3)
    with pytest.raises(ConfigError, match="unknown model 'resnet9000'"):
        create_model(ModelSpec("resnet9000", [1, 8, 8], 10))
    with pytest.raises(ConfigError, match="cannot import factory"):
        create_model(ModelSpec("tests.models.nope:f", [4], 3))
    with pytest.raises(ConfigError, match="cnn needs image inputs"):
        create_model(ModelSpec("cnn", [64], 10))
    with pytest.raises(ConfigError, match="not accepted"):
        create_model(ModelSpec("mlp", [4], 3, {"depth": 3}))
