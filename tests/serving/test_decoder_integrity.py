"""A decoder version's integrity: every file digested at registration, checked at promote, reload and start-up."""

from __future__ import annotations

import json
import shutil
import time

import pytest

pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")
pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from pruneops.core.errors import ConfigError  # noqa: E402
from pruneops.modelstore.store import ModelRegistry, RegistryError  # noqa: E402
from pruneops.serving.decoder_service import production_service  # noqa: E402
from pruneops.serving.generate import DecoderService, create_decoder_app, follow_production  # noqa: E402


def _registry(tiny_genai_decoder, root, versions=("v1", "v2")) -> ModelRegistry:
    registry = ModelRegistry(root / "models")
    for version in versions:
        registry.register(tiny_genai_decoder[1], {"task": "causal_lm", "precision": "fp32"}, version=version)
    return registry


def _flip(path, count=2000) -> None:
    data = bytearray(path.read_bytes())
    step = max(1, len(data) // count)
    for i in range(0, len(data), step):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _weights(folder):
    return max((p for p in folder.iterdir() if p.name.startswith("model.onnx")), key=lambda p: p.stat().st_size)


def test_every_file_of_a_decoder_version_is_digested_and_a_changed_one_is_never_promoted(tiny_genai_decoder, tmp_path):
    registry = _registry(tiny_genai_decoder, tmp_path)
    files = registry.get("v1").metadata["files_sha256"]
    assert {"genai_config.json", "tokenizer.json", "model.onnx"} <= set(files)
    registry.promote("v1")
    _flip(_weights(registry.get("v2").path))
    with pytest.raises(RegistryError, match="checksum mismatch"):
        registry.promote("v2")
    assert registry.production().version == "v1"
    # A file added after registration (a chat template that changes every chat prompt) is refused too.
    (registry.get("v1").path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    with pytest.raises(RegistryError, match="chat_template.jinja: not among the files recorded"):
        registry.promote("v1")


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda c: c["model"].update(context_length=1), "context holds 1 tokens"),
        (lambda c: c["model"].update(type="no-such-family"), "does not load as the server loads it"),
    ],
)
def test_a_decoder_the_server_cannot_use_is_refused_at_promotion(tiny_genai_decoder, tmp_path, edit, why):
    folder = tmp_path / "export"
    shutil.copytree(tiny_genai_decoder[1], folder)
    config = json.loads((folder / "genai_config.json").read_text())
    edit(config)
    (folder / "genai_config.json").write_text(json.dumps(config))
    registry = ModelRegistry(tmp_path / "models")
    registry.register(tiny_genai_decoder[1], {"task": "causal_lm"}, version="v1")
    registry.promote("v1")
    registry.register(folder, {"task": "causal_lm"}, version="v2")  # its digests are of the bad config
    with pytest.raises(RegistryError, match=why):
        registry.promote("v2")
    assert registry.production().version == "v1"


def test_a_corrupt_version_is_never_hot_reloaded_or_served_after_a_restart(tiny_genai_decoder, tmp_path):
    registry = _registry(tiny_genai_decoder, tmp_path, ("v1", "v2", "v3"))
    registry.promote("v1")
    registry.promote("v2")
    service = production_service(registry.root)
    assert service.metrics.version == "v2" and service.fallback_from is None
    client = TestClient(create_decoder_app(service))
    registry.promote("v3")  # checked and promoted; its weights rot before the server reloads them
    _flip(_weights(registry.get("v3").path))
    follow_production(service, registry.root, 0.05)
    deadline = time.time() + 10
    while time.time() < deadline and service.metrics.reload_errors._value.get() < 1:
        time.sleep(0.05)
    assert service.metrics.reload_errors._value.get() == 1 and service.metrics.version == "v2"
    assert client.post("/generate", json={"prompt": "the people", "max_new_tokens": 2}).status_code == 200
    # A restart with v3 (corrupt) in production serves the version before it in the served stack.
    restarted = production_service(registry.root)
    assert restarted.metrics.version == "v2" and restarted.fallback_from == "v3"
    assert TestClient(create_decoder_app(restarted)).get("/healthz").json()["fallback_from"] == "v3"
    for version in ("v2", "v1"):
        _flip(_weights(registry.get(version).path))
    with pytest.raises(ConfigError, match="no production version can be served: v3: .*checksum mismatch.*; v2: .*; v1"):
        production_service(registry.root)


def test_a_served_folder_outside_the_registry_is_loaded_as_given(tiny_genai_decoder):
    service = DecoderService(tiny_genai_decoder[1], None)  # no metadata.json: no digests to check
    assert service.metrics.version == tiny_genai_decoder[1].name
