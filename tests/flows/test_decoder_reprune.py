"""The decoder path end to end: `dvc repro` by params, then served from the registry, prompt drift in
Prometheus, a gated re-prune as a DVC experiment, and the server on the promoted model."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")
pytestmark = pytest.mark.skipif(
    not shutil.which("prometheus"), reason="Debian's prometheus is not installed (make monitoring-deps)"
)

from pruneops.pipeline.stages import STAGE_NAMES  # noqa: E402
from tests.conftest import free_port, post_json, wait_http, write_params  # noqa: E402
from tests.decoder_helpers import WORDS, decoder_params, save_small_llama, speeches  # noqa: E402


def _project(root: Path, prometheus: str) -> Path:
    from pruneops.pipeline.dvcfile import write_dvc_yaml
    from pruneops.pipeline.experiments import tool_env

    save_small_llama(root / "model")
    (root / "corpus.txt").write_text("\n\n".join(speeches(120)))
    params = decoder_params(Path("model"), Path("corpus.txt"))
    # A tolerance and SLOs this loose promote any working candidate: the test is of the loop.
    params["reprune"] = {
        "drift_source": prometheus,
        "perplexity_tolerance": 10.0,
        "decode_slo_ms": 1000.0,
        "prefill_slo_ms": 10000.0,
    }
    write_params(root, params)
    write_dvc_yaml(root)
    (root / ".gitignore").write_text("/state/\n/models/\n")  # the feedback is versioned by the flow (dvc add)
    env = tool_env()
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "p"]):
        subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True)
    out = subprocess.run(["dvc", "repro"], cwd=root, env=env, check=True, capture_output=True, text=True, timeout=900)
    assert [s for s in STAGE_NAMES if f"Running stage '{s}'" in out.stdout] == list(STAGE_NAMES)
    again = subprocess.run(["dvc", "repro"], cwd=root, env=env, check=True, capture_output=True, text=True)
    assert "Running stage" not in again.stdout
    for cmd in (["git", "add", "-A"], ["git", "commit", "-qm", "repro"]):
        subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True)
    return root


def _check_pipeline_metrics(root: Path) -> None:
    """What `dvc repro` of the decoder path measured, each figure against its own bound."""
    metrics = {s: json.loads((root / "metrics" / f"{s}.json").read_text()) for s in STAGE_NAMES}
    assert metrics["validate"]["expectations_failed"] == 0 and metrics["validate"]["blocks"]["test"] >= 1
    assert sorted(metrics["sensitivity"]["layer_order"]) == [0, 1, 2, 3]
    prune = metrics["prune"]
    assert prune["predicted_ms"] <= prune["target_ms"] + 1e-9 and prune["measured_speedup"] > 1.0
    assert metrics["finetune"]["tokens"] == 256
    assert metrics["export"]["greedy_tokens_equal"] == metrics["export"]["greedy_tokens_checked"] == 16
    bench = metrics["benchmark"]
    low, high = bench["test_perplexity_ratio_ci"]
    assert low <= bench["test_perplexity_ratio"] <= high and bench["speedup_b1"] > 1.0
    assert (root / "artifacts/export/model/genai_config.json").is_file()
    assert (root / "plots/benchmark/frontier.png").is_file()


def _start(root: Path, ports: dict[str, int], work: Path) -> list[subprocess.Popen]:
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "decoder", "static_configs": [{"targets": [f"127.0.0.1:{ports['serve']}"]}]}],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    serve = [sys.executable, "-m", "pruneops.cli", "--root", str(root), "serve-decoder", "--registry", "models"]
    serve += ["--feedback-file", "data/feedback/feedback.jsonl", "--reload-interval", "1"]
    serve += ["--port", str(ports["serve"])]
    prometheus = ["prometheus", f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}"]
    prometheus.append(f"--web.listen-address=127.0.0.1:{ports['prometheus']}")
    return [
        subprocess.Popen(serve, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        subprocess.Popen(prometheus, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]


# ~9 min: dvc repro of the decoder path by params alone (four minutes; real timings, no injection: the
# run is DVC's) and a no-op repro, then the same pipeline as the re-prune's DVC experiment on the
# served feedback, and the gate's genai scoring and timing.
@pytest.mark.e2e
@pytest.mark.slow(reason="two decoder pipeline runs (dvc repro, then the re-prune experiment) and live servers")
def test_dvc_repro_then_prompt_drift_starts_a_gated_reprune_that_the_server_follows(tmp_path):
    from flows.drift import drift_check
    from flows.reprune import reprune
    from pruneops.cli import main

    ports = {"serve": free_port(), "prometheus": free_port()}
    prometheus = f"http://127.0.0.1:{ports['prometheus']}"
    root = _project(tmp_path / "project", prometheus)
    _check_pipeline_metrics(root)
    assert main(["--root", str(root), "publish"]) == 0
    procs = _start(root, ports, tmp_path)
    try:
        serve = f"http://127.0.0.1:{ports['serve']}"
        wait_http(f"{serve}/healthz", timeout=60)
        wait_http(f"{prometheus}/-/ready", timeout=60)
        first = json.loads(urllib.request.urlopen(f"{serve}/healthz", timeout=10).read())["version"]
        for text in speeches(40, seed=5):  # in-domain traffic, each answer followed by its reference
            words = text.split()
            prompt, continuation = " ".join(words[:20]), " ".join(words[20:])
            assert post_json(f"{serve}/generate", {"prompt": prompt, "max_new_tokens": 4})["tokens"] >= 1
            post_json(f"{serve}/feedback", {"prompt": prompt, "continuation": continuation})
        shifted = " ".join(WORDS[-6:])  # six words over and over: a token histogram unlike the corpus's
        for _ in range(80):
            post_json(f"{serve}/generate", {"prompt": " ".join([shifted] * 5), "max_new_tokens": 2})
        deadline, check = time.time() + 60, {"triggered": False}
        while time.time() < deadline and not check["triggered"]:
            time.sleep(2)
            check = drift_check(project_dir=str(root))
        assert check["triggered"] and check["score"] > check["threshold"], check

        record = reprune(project_dir=str(root), reason=f"prompt drift {check['score']:.2f}")
        assert record["promoted"], record["reasons"]
        assert any("holdout perplexity" in r for r in record["reasons"]), record["reasons"]
        for rule in ("time per output token", "time to first token"):
            assert any(r.startswith(rule) for r in record["reasons"]), record["reasons"]
        deadline, version = time.time() + 30, first
        while time.time() < deadline and version == first:
            time.sleep(1)
            version = json.loads(urllib.request.urlopen(f"{serve}/healthz", timeout=10).read())["version"]
        assert version == record["candidate_version"] != first
        assert post_json(f"{serve}/generate", {"prompt": "thank you", "max_new_tokens": 3})["tokens"] >= 1
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=20)
