#!/usr/bin/env bash
# Smoke test of `pruneops serve-decoder` in the serving image (no torch): a tiny random Llama built
# on the host (transformers, then onnxruntime-genai's builder), published into a scratch registry,
# served by the image with its decoder command; /generate (plain and streamed) and the OpenAI API's
# /v1/completions (compared with the host's greedy tokens of the same ONNX model), /metrics and the
# healthcheck are checked.
# Needs the `llm` extra on the host and a built image (docker/build-images.sh serving).
set -euo pipefail
cd "$(dirname "$0")/.."
engine=${CONTAINER_ENGINE:-$(command -v podman >/dev/null 2>&1 && echo podman || echo docker)}
py=.venv/bin/python
image=pruneops-serving:latest
port=${SMOKE_DECODER_PORT:-18001}
name=pruneops-smoke-decoder-$$
work=$(mktemp -d /tmp/pruneops-smoke-decoder.XXXX)
cleanup() { "$engine" rm -f "$name" >/dev/null 2>&1 || true; rm -rf "$work"; }
trap cleanup EXIT

$py - "$work" <<'PY'
import sys
from pathlib import Path

from pruneops.modelstore.store import ModelRegistry
from pruneops.runtimes.genai.generation import build_genai_model
from tests.decoder_helpers import save_tiny

work = Path(sys.argv[1])
folder = build_genai_model(save_tiny("llama", work / "hf"), work / "onnx", "fp32", threads=1)
registry = ModelRegistry(work / "models")
registry.register(folder, {"task": "causal_lm", "precision": "fp32"}, version="v1")
registry.promote("v1")
PY
chmod -R a+rX "$work"

"$engine" run -d --name "$name" --network host -e PRUNEOPS_HOST=127.0.0.1 -e "PRUNEOPS_PORT=$port" \
  -v "$work/models:/app/models:ro" --entrypoint sh "$image" \
  -c 'exec pruneops --root /app serve-decoder --registry models --host "$PRUNEOPS_HOST" --port "$PRUNEOPS_PORT"' \
  >/dev/null 2>"$work/run.err" || { cat "$work/run.err" >&2; exit 1; }  # (podman's systemd notices are noise)
$py - "$port" "$work" <<'PY'
import json, sys, time, urllib.request
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from pruneops.runtimes.genai.generation import greedy_tokens

base, work = f"http://127.0.0.1:{sys.argv[1]}", Path(sys.argv[2])
def get(path):
    with urllib.request.urlopen(base + path, timeout=5) as r:
        return r.read().decode()

def post(body, path="/generate"):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read().decode()

for _ in range(120):  # bounded: 60 s
    try:
        health = json.loads(get("/healthz"))
        break
    except OSError:
        time.sleep(0.5)
else:
    sys.exit("FAIL: the decoder container never answered /healthz")
prompt = "the people of our nation"
plain = json.loads(post({"prompt": prompt, "max_new_tokens": 8}))
streamed = post({"prompt": prompt, "max_new_tokens": 8, "stream": True})
tokenizer = Tokenizer.from_file(str(work / "onnx/tokenizer.json"))
ids = np.asarray([tokenizer.encode(prompt, add_special_tokens=False).ids], dtype=np.int32)
expected = tokenizer.decode(greedy_tokens(work / "onnx", ids, 8)[0][: plain["tokens"]].tolist(), skip_special_tokens=True)
completion = json.loads(post({"model": "models", "prompt": prompt, "max_tokens": 8, "temperature": 0}, "/v1/completions"))
metrics = get("/metrics")
checks = {
    "OpenAI completion is the greedy text": completion["choices"][0]["text"] == expected,
    "serves v1": health.get("version") == "v1",
    "greedy text is the host's": plain["text"] == expected,
    "stream ends with done": streamed.rstrip().split("\n\n")[-1].startswith("event: done"),
    "tokens counted": f"pruneops_generated_tokens_total {3.0 * plain['tokens']}" in metrics,
    "TPOT histogram": "pruneops_time_per_output_token_seconds_bucket" in metrics,
}
print(json.dumps({"tokens": plain["tokens"], "ttft_ms": round(plain["ttft_ms"], 2), **checks}))
if not all(checks.values()):
    sys.exit("FAIL: " + ", ".join(k for k, ok in checks.items() if not ok))
PY
"$engine" exec "$name" python -m pruneops.serving.healthcheck "http://127.0.0.1:$port/healthz"
echo "ok: decoder serving smoke passed ($image)"
