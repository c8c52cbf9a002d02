#!/usr/bin/env bash
# Worker image entry point. Commands:
#   deploy    first model if none is in production, then serve the Prefect deployments (default)
#   server    the Prefect server (UI and API on :4200)
#   receiver  the Alertmanager receiver (:8010; needs PRUNEOPS_RECEIVER_TOKEN)
#   repro     dvc repro on the project's params.yaml
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
  *)
    exec "$@"
    ;;
esac
