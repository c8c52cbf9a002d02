"""Model architectures, chosen by name through `MODELS` (or `package.module:factory`)."""

from pruneops.models.registry import MODELS, ModelSpec, classifier_of, create_model

__all__ = ["MODELS", "ModelSpec", "classifier_of", "create_model"]
