"""The generated pages: current in the tree, and read from the code and the reports they describe."""

import json
import re
import shutil

from prometheus_client import generate_latest

from pruneops.cli import build_parser, main
from pruneops.compare.results import HEADLINE_END, HEADLINE_START, read_results
from pruneops.config import PruneConfig
from pruneops.pipeline.stages import STAGES
from pruneops.reports.pages import generated_files, metrics_page, params_page, stale_files, write_files
from pruneops.serving.app import Metrics
from tests.conftest import ROOT

REFERENCE = ROOT / "docs" / "reference"


def test_the_committed_reference_results_page_and_readme_table_are_current():
    files = generated_files(ROOT, build_parser())
    assert {ROOT / "docs/results.md", ROOT / "README.md", REFERENCE / "params.md"} <= set(files)
    stale = stale_files(files)
    assert stale == [], f"stale generated files {stale}: run `pruneops reference`"


def test_check_names_a_page_that_no_longer_matches_the_code(tmp_path, capsys):
    write_files(generated_files(tmp_path, build_parser()))
    assert main(["--root", str(tmp_path), "reference", "--check"]) == 0
    page = tmp_path / "docs/reference/params.md"
    page.write_text(page.read_text().replace("| `steps` | int | `4` |", "| `steps` | int | `5` |"))
    assert main(["--root", str(tmp_path), "reference", "--check"]) == 1
    assert "params.md is stale" in capsys.readouterr().err


def test_the_results_page_and_readme_table_follow_the_workload_reports(tmp_path, capsys):
    """A rerun of a workload replaces its results.json: the page and the README's row must follow."""
    shutil.copytree(ROOT / "docs/results", tmp_path / "docs/results")
    (tmp_path / "README.md").write_text(f"# x\n\n{HEADLINE_START}\n{HEADLINE_END}\n")
    write_files(generated_files(tmp_path, build_parser()))
    page = (tmp_path / "docs/results.md").read_text()
    results = read_results(tmp_path / "docs")
    assert len(results) == len(list((tmp_path / "docs/results").glob("*/*/results.json"))) > 0
    for result in results:  # one row per workload, linked to its report
        assert page.count(f"]({result.report.as_posix()})") == 1 and (tmp_path / "docs" / result.report).is_file()
    vision = tmp_path / "docs/results/vision/fashion-mobilenetv2/results.json"
    data = json.loads(vision.read_text())
    assert f"{data['selected']['speedup_b1']:.2f}×" in (tmp_path / "README.md").read_text()
    data["selected"]["speedup_b1"] = 9.99
    vision.write_text(json.dumps(data))
    assert main(["--root", str(tmp_path), "reference", "--check"]) == 1
    err = capsys.readouterr().err
    assert "results.md is stale" in err and "README.md is stale" in err
    write_files(generated_files(tmp_path, build_parser()))
    assert "9.99×" in (tmp_path / "docs/results.md").read_text() and "9.99×" in (tmp_path / "README.md").read_text()


def test_params_rows_carry_each_keys_type_default_and_bounds():
    text = params_page().text
    steps = PruneConfig.model_fields["steps"]
    assert f"| `steps` | int | `{steps.default}` | ≥ 1, ≤ 1000 |" in text
    assert '| `kind` | "ratio" \\| "macs" \\| "params" \\| "latency_ms" \\| "latency_ratio" | required |' in text
    for block in ("target", "gate", "trials", "distillation"):  # each nested block has its own table
        assert f"## `prune.{block}`" in text and f"| `{block}` |" in text
    sections = re.findall(r"^## `(\w+)`$", text, flags=re.MULTILINE)
    assert sections[: len(STAGES)] == [s.name for s in STAGES]
    assert {"reprune", "serve"} <= set(sections)
    for stage in STAGES:  # every key of every section has a row
        block = text.split(f"## `{stage.name}`\n", 1)[1].split("\n## ", 1)[0]
        assert {m for m in re.findall(r"^\| `(\w+)` \|", block, flags=re.MULTILINE)} == set(stage.config.model_fields)
    # ... and every key the embedded params.yaml writes has help, from its comment there
    written = [s.name for s in STAGES] + [f"prune.{b}" for b in ("target", "gate", "trials", "distillation")]
    for section in written:
        block = text.split(f"## `{section}`\n", 1)[1].split("\n## ", 1)[0]
        rows = re.findall(r"^\| `(\w+)` \|.*\| ([^|]*) \|$", block, flags=re.MULTILINE)
        assert rows and [key for key, help_text in rows if not help_text.strip()] == [], section


def test_the_metrics_page_lists_every_metric_the_server_exposes():
    exposed = set(re.findall(r"^# TYPE (\w+) ", generate_latest(Metrics().registry).decode(), flags=re.MULTILINE))
    # prometheus_client adds a `<counter>_created` timestamp beside each counter: not a metric of ours.
    exposed -= {name for name in exposed if name.endswith("_created") and name[:-8] + "_total" in exposed}
    listed = set(re.findall(r"^\| `(\w+)` \|", metrics_page().text, flags=re.MULTILINE))
    assert listed == exposed and len(listed) >= 10
