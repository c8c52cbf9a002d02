#!/usr/bin/env bash
# Worker image entry point. Commands:
#   deploy    first model if none is in production, then serve the Prefect deployments (default)
#   server    the Prefect server (UI and API on :4200)
#   receiver  the Alertmanager receiver (:8010; needs PRUNEOPS_RECEIVER_TOKEN)
#   repro     dvc repro on the project's params.yaml
#   ray-head  the Ray head (GCS on :6379, no CPUs of its own: tasks go to the ray workers)
#   ray-worker a Ray worker node joining RAY_HEAD (host:port) with RAY_NUM_CPUS CPUs (default: all)
#   pool-worker a Prefect worker on the process work pool PREFECT_POOL (created if missing)
# The Ray nodes authenticate with the shared RAY_AUTH_TOKEN (RAY_AUTH_MODE=token).
#   anything else runs as given.
# PRUNEOPS_SET="reprune.key=value serve.key=value ..." sets the deployment's orchestration params in
# memory (params.yaml is never written); stage params change through DVC experiments.
set -euo pipefail
cd /app
command=${1:-deploy}
case "$command" in
  deploy)
    python -m flows.bootstrap --project-dir /app
    exec python -m flows.deploy --project-dir /app
    ;;
  server)
    mkdir -p "$PREFECT_HOME"
    exec prefect server start --host "${PREFECT_SERVER_HOST:-0.0.0.0}" --port "${PREFECT_SERVER_PORT:-4200}"
    ;;
  receiver)
    exec python -m flows.receiver --host 0.0.0.0 --port 8010
    ;;
  repro)
    exec dvc repro
    ;;
  ray-head)
    exec ray start --head --block --port=6379 --num-cpus=0 --include-dashboard=false --disable-usage-stats
    ;;
  ray-worker)
    exec ray start --block --address="${RAY_HEAD:?set RAY_HEAD (host:port of the Ray head)}" \
      ${RAY_NUM_CPUS:+--num-cpus="$RAY_NUM_CPUS"} --disable-usage-stats
    ;;
  pool-worker)
    exec prefect worker start --pool "${PREFECT_POOL:-pruneops}" --type process
    ;;
  *)
    exec "$@"
    ;;
esac
