#!/usr/bin/env bash
# Smoke test of `pruneops serve-decoder` in the serving image (no torch), once per decoder runtime
# the export stage ships: a tiny random Llama built on the host (transformers, then onnxruntime-genai's
# builder; and llama.cpp's GGUF converter, with SmolLM2's tokenizer, which the converter knows),
# published into a scratch registry, served by the image with its decoder command; /generate (plain
# and streamed) and the OpenAI API's /v1/completions (compared with the host's greedy tokens of the
# same export in the same runtime), /metrics and the healthcheck are checked.
# Needs the `llm` extra on the host and a built image (docker/build-images.sh serving); the GGUF half
# also needs `make llama-cpp llm-assets` on the host and an image built with llama.cpp (its default).
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

runtimes=(genai)
if "$engine" run --rm --network none --entrypoint python "$image" -c "import llama_cpp" >/dev/null 2>&1; then
  if $py -c "import llama_cpp" 2>/dev/null && [ -f assets/llm/smollm2-135m/tokenizer.json ]; then
    runtimes+=(llamacpp)
  else
    echo "not checked: $image's llama.cpp (GGUF) serving: the host lacks llama-cpp-python or SmolLM2's tokenizer (make llama-cpp llm-assets)"
  fi
else
  echo "note: $image was built without llama.cpp (LLAMA_CPP_PYTHON empty): its GGUF serving is not checked"
fi

$py - "$work" "${runtimes[@]}" <<'PY'
import sys
from pathlib import Path

from pruneops.modelstore.store import ModelRegistry
from pruneops.runtimes import get_runtime
from tests.decoder_helpers import family_decoder, tiny_decoder, tiny_tokenizer

work, runtimes = Path(sys.argv[1]), sys.argv[2:]
for name in runtimes:
    if name == "genai":  # the tiny tokenizer: the genai builder reads any
        model, tokenizer = tiny_decoder("llama"), tiny_tokenizer()
    else:  # llama.cpp's converter knows a tokenizer by its pre-tokenizer: SmolLM2's
        from pruneops.models.decoders import load_causal_tokenizer

        tokenizer = load_causal_tokenizer(Path("assets/llm/smollm2-135m"))
        model = family_decoder("llama", layers=2, vocab_size=len(tokenizer))
    folder = get_runtime(name).export(model.eval(), work / name, ["fp32"], tokenizer=tokenizer)["fp32"]
    registry = ModelRegistry(work / f"models-{name}")
    registry.register(folder, {"task": "causal_lm", "precision": "fp32"}, version="v1")
    registry.promote("v1")
    (work / f"{name}.folder").write_text(str(folder))  # the export the host checks the served tokens against
PY
chmod -R a+rX "$work"

for runtime in "${runtimes[@]}"; do
  "$engine" run -d --name "$name" --network host -e PRUNEOPS_HOST=127.0.0.1 -e "PRUNEOPS_PORT=$port" \
    -v "$work/models-$runtime:/app/models:ro" --entrypoint sh "$image" \
    -c 'exec pruneops --root /app serve-decoder --registry models --host "$PRUNEOPS_HOST" --port "$PRUNEOPS_PORT"' \
    >/dev/null 2>"$work/run.err" || { cat "$work/run.err" >&2; exit 1; }  # (podman's systemd notices are noise)
  $py - "$port" "$(cat "$work/$runtime.folder")" "$runtime" <<'PY' || { "$engine" logs "$name" 2>&1 | tail -20 >&2; exit 1; }
import json, sys, time, urllib.request
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from pruneops.runtimes import get_runtime

base, folder, runtime = f"http://127.0.0.1:{sys.argv[1]}", Path(sys.argv[2]), sys.argv[3]
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
    sys.exit(f"FAIL: the decoder container ({runtime}) never answered /healthz")
prompt = "the people of our nation"
plain = json.loads(post({"prompt": prompt, "max_new_tokens": 8}))
streamed = post({"prompt": prompt, "max_new_tokens": 8, "stream": True})
tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
ids = np.asarray([tokenizer.encode(prompt, add_special_tokens=False).ids], dtype=np.int32)
host = get_runtime(runtime).open(folder).greedy(ids, 8)[0]  # the same export, the host's runtime
expected = tokenizer.decode(host[: plain["tokens"]].tolist(), skip_special_tokens=True)
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
print(json.dumps({"runtime": runtime, "tokens": plain["tokens"], "ttft_ms": round(plain["ttft_ms"], 2), **checks}))
if not all(checks.values()):
    sys.exit("FAIL: " + ", ".join(k for k, ok in checks.items() if not ok))
PY
  "$engine" exec "$name" python -m pruneops.serving.healthcheck "http://127.0.0.1:$port/healthz"
  "$engine" rm -f "$name" >/dev/null 2>&1
  echo "ok: decoder serving smoke passed in $runtime ($image)"
done
