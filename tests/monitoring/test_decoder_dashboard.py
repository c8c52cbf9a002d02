"""The decoder dashboard on live servers: a tiny exported Llama served by `serve-decoder`'s app, a
real Prometheus with the recording rules scraping it, traffic, then every panel's PromQL."""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import pytest
import yaml

pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")
pytest.importorskip("uvicorn")

from tests.conftest import ROOT, free_port, post_json, wait_http  # noqa: E402
from tests.decoder_helpers import WORDS, speeches, tiny_tokenizer  # noqa: E402
from tests.monitoring.helpers import panels_without_data, prom_query  # noqa: E402

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not shutil.which("prometheus"), reason="Debian's prometheus is not installed"),
]
MON = ROOT / "monitoring"


def _prometheus(work, target: str, port: int) -> subprocess.Popen:
    shutil.copy(MON / "rules/recording.yml", work / "recording.yml")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(work / "recording.yml")],
        "scrape_configs": [{"job_name": "decoder", "static_configs": [{"targets": [target]}]}],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    command = ["prometheus", f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'tsdb'}"]
    command.append(f"--web.listen-address=127.0.0.1:{port}")
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_every_decoder_panel_has_data_from_a_live_prometheus(tmp_path, tiny_genai_decoder):
    import uvicorn

    from pruneops.data.drift import prompt_reference
    from pruneops.serving.generate import DecoderService, create_decoder_app

    folder = tiny_genai_decoder[1]
    tok = tiny_tokenizer()
    reference = prompt_reference([tok(t, add_special_tokens=False)["input_ids"] for t in speeches(80, seed=1)])
    service = DecoderService(folder, reference, drift_window=2000, decode_slo_ms=50.0, prefill_slo_ms=500.0)
    ports = {"serve": free_port(), "prometheus": free_port()}
    server = uvicorn.Server(
        uvicorn.Config(create_decoder_app(service), host="127.0.0.1", port=ports["serve"], log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    prometheus = _prometheus(tmp_path, f"127.0.0.1:{ports['serve']}", ports["prometheus"])
    serve, prom = f"http://127.0.0.1:{ports['serve']}", f"http://127.0.0.1:{ports['prometheus']}"
    try:
        wait_http(f"{serve}/healthz")
        wait_http(f"{prom}/-/ready", timeout=60)
        deadline = time.time() + 60  # traffic across several scrapes: rates need two samples
        texts = iter(speeches(200, seed=2))
        while time.time() < deadline and not prom_query(prom, "pruneops:time_per_output_token_seconds:p95"):
            text = next(texts).split()
            post_json(f"{serve}/generate", {"prompt": " ".join(text[:12]), "max_new_tokens": 6})
            post_json(f"{serve}/feedback", {"prompt": " ".join(text[:12]), "continuation": " ".join(text[12:24])})
            post_json(f"{serve}/generate", {"prompt": " ".join(WORDS[-4:] * 10), "max_new_tokens": 2})
            time.sleep(0.2)
        time.sleep(2)  # one more scrape and rule evaluation after the last request
        empty = panels_without_data(prom, "pruneops-decoder.json")
        assert not empty, f"panels without data: {empty}"
        (tpot,) = prom_query(prom, "pruneops:time_per_output_token_seconds:p95")
        assert 0 < float(tpot["value"][1]) <= 1.0  # within the histogram's finite buckets
        (info,) = prom_query(prom, "pruneops_model_info")
        assert info["metric"]["model_version"] == "v1"
    finally:
        server.should_exit = True
        prometheus.terminate()
        prometheus.wait(timeout=20)
        thread.join(timeout=10)
