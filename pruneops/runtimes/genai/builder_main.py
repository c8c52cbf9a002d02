"""onnxruntime-genai's model builder, run on configs as transformers 5 writes them.

`python -m pruneops.runtimes.genai.builder_main <the builder's arguments>` runs the builder's own
command line after one adaptation: transformers 5 keeps the RoPE parameters of models with
sliding and global layers per layer type (`rope_parameters: {"full_attention": {...},
"sliding_attention": {...}}`, Gemma 3), where the builder (0.18) reads one flat dict and, for the
local layers, `rope_local_base_freq`. The global layers' dict becomes the flat one and the sliding
layers' theta the local frequency; a config already flat is left as it is. Nothing else changes,
and the export is checked against torch's greedy tokens like any other.
"""

from __future__ import annotations

import runpy


def _flatten_rope_per_layer_type(config: object) -> None:
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or "rope_type" in params or "full_attention" not in params:
        return
    config.rope_parameters = dict(params["full_attention"])
    sliding = params.get("sliding_attention")
    if sliding is not None and getattr(config, "rope_local_base_freq", None) is None:
        config.rope_local_base_freq = sliding["rope_theta"]


def _patch_builder() -> None:
    import onnxruntime_genai.models  # noqa: F401 - puts the builder's folder on sys.path, as the builder does
    from builders import base  # the module object the builder itself imports (not ...models.builders.base)

    original = base.Model.make_rope_init

    def make_rope_init(self: object, config: object) -> None:
        _flatten_rope_per_layer_type(config)
        original(self, config)

    base.Model.make_rope_init = make_rope_init


if __name__ == "__main__":
    _patch_builder()
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__", alter_sys=True)
