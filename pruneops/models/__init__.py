"""Model architectures, chosen by name through `MODELS` (or `package.module:factory`).

Importing the package registers the built-in families (their modules import `MODELS` from
`pruneops.models.registry`, which imports none of them).
"""

from pruneops.models import architectures, efficientnet, hf, mobilenet
from pruneops.models.registry import MODELS, ModelSpec, classifier_of, create_model

__all__ = ["MODELS", "ModelSpec", "architectures", "classifier_of", "create_model", "efficientnet", "hf", "mobilenet"]
