#!/usr/bin/env bash
# Smoke test of the serving image: the pipeline's pruned INT8 model, published into a scratch
# registry, served by pruneops-serving (no torch); /readyz, /predict (accuracy on real test
# inputs), /metrics and the image's healthcheck are checked. Needs `make run` outputs (runs it
# when missing) and a built image (docker/build-images.sh serving).
set -euo pipefail
cd "$(dirname "$0")/.."
engine=${CONTAINER_ENGINE:-$(command -v podman >/dev/null 2>&1 && echo podman || echo docker)}
py=.venv/bin/python
image=pruneops-serving:latest
port=${SMOKE_PORT:-18000}
name=pruneops-smoke-serving-$$
work=$(mktemp -d /tmp/pruneops-smoke.XXXX)
cleanup() { "$engine" rm -f "$name" >/dev/null 2>&1 || true; rm -rf "$work"; }
trap cleanup EXIT

[ -f artifacts/export/pruned_deployed.onnx ] || make run
.venv/bin/pruneops publish --registry "$work/models" >/dev/null
chmod -R a+rX "$work"

if "$engine" run --rm --network none --entrypoint python "$image" -c "import torch" >/dev/null 2>&1; then
  echo "FAIL: the serving image can import torch" >&2; exit 1
fi
echo "ok: no torch in $image"

# The image's own command, on the host network bound to loopback (the netavark bridge is not
# available on every machine).
"$engine" run -d --name "$name" --network host -e PRUNEOPS_HOST=127.0.0.1 -e "PRUNEOPS_PORT=$port" \
  -v "$work/models:/app/models:ro" "$image" >/dev/null
$py - "$port" <<'PY'
import json, sys, time, urllib.request
import numpy as np

base = f"http://127.0.0.1:{sys.argv[1]}"
def get(path):
    with urllib.request.urlopen(base + path, timeout=5) as r:
        return r.read().decode()

for _ in range(120):  # bounded: 60 s
    try:
        ready = json.loads(get("/readyz"))
        break
    except OSError:
        time.sleep(0.5)
else:
    sys.exit("FAIL: the serving container never became ready")
with np.load("artifacts/validate/test.npz") as test:
    x, y = test["x"][:200], test["y"][:200]
req = urllib.request.Request(base + "/predict", data=json.dumps({"inputs": x.tolist()}).encode(),
                             headers={"content-type": "application/json"})
with urllib.request.urlopen(req, timeout=30) as r:
    body = json.loads(r.read())
accuracy = float(np.mean(np.array(body["classes"]) == y))
metrics = get("/metrics")
checks = {
    "ready": ready.get("status") == "ready",
    "accuracy >= 0.9": accuracy >= 0.9,
    "request counted": 'pruneops_requests_total{endpoint="predict",status="200"} 1.0' in metrics,
    "latency histogram": "pruneops_inference_latency_seconds_bucket" in metrics,
    "drift scored": 'pruneops_drift_score{group="overall"}' in metrics,
}
print(json.dumps({"model_version": body["model_version"], "accuracy_200": accuracy, **checks}))
if not all(checks.values()):
    sys.exit("FAIL: " + ", ".join(k for k, ok in checks.items() if not ok))
PY
"$engine" healthcheck run "$name" 2>/dev/null  # (podman's systemd timer notice is noise here)
echo "ok: the image's healthcheck passes"
size=$("$engine" image inspect "$image" --format '{{.Size}}')
echo "ok: serving smoke passed ($image, $(( size / 1000000 )) MB)"
