#!/usr/bin/env bash
# Builds pruneops-worker and pruneops-serving (both by default, or the ones named).
#   docker/build-images.sh [worker] [serving]
# CONTAINER_ENGINE picks podman or docker (default: podman when installed). BASE_IMAGE overrides
# the python slim base. On a machine that reaches package registries only through a local CA and
# a wheel folder (PIP_CERT, PIP_FIND_LINKS set, podman), those are mounted into the build and the
# CPU torch wheel is taken from the folder. LLAMA_CPP_PYTHON (a version, or empty to leave llama.cpp
# out of the serving image) and LLAMA_CPP_CMAKE_ARGS are passed on where set (Dockerfile.serving).
set -euo pipefail
cd "$(dirname "$0")/.."
engine=${CONTAINER_ENGINE:-$(command -v podman >/dev/null 2>&1 && echo podman || echo docker)}
images=("$@")
[ ${#images[@]} -gt 0 ] || images=(worker serving)

args=()
[ -z "${BASE_IMAGE:-}" ] || args+=(--build-arg "BASE_IMAGE=$BASE_IMAGE")
[ -z "${LLAMA_CPP_PYTHON+set}" ] || args+=(--build-arg "LLAMA_CPP_PYTHON=$LLAMA_CPP_PYTHON")
[ -z "${LLAMA_CPP_CMAKE_ARGS:-}" ] || args+=(--build-arg "LLAMA_CPP_CMAKE_ARGS=$LLAMA_CPP_CMAKE_ARGS")
if [ "$engine" = podman ]; then
  # docker format keeps HEALTHCHECK (OCI images drop it).
  args+=(--network host --format docker)
  if [ -n "${PIP_CERT:-}" ]; then
    args+=(-v "$PIP_CERT:/etc/ssl/certs/ca-certificates.crt:ro" --build-arg "PIP_CERT=/etc/ssl/certs/ca-certificates.crt")
  fi
  if [ -n "${PIP_FIND_LINKS:-}" ]; then
    args+=(-v "$PIP_FIND_LINKS:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels --build-arg TORCH_INDEX=)
  fi
fi

for image in "${images[@]}"; do
  start=$(date +%s)
  echo "building pruneops-$image with $engine ..."
  "$engine" build "${args[@]}" -f "docker/Dockerfile.$image" -t "pruneops-$image:latest" .
  size=$("$engine" image inspect "pruneops-$image:latest" --format '{{.Size}}')
  echo "pruneops-$image: built in $(( $(date +%s) - start )) s, $(( size / 1000000 )) MB"
done
