"""The generated reference pages: current in the tree, and read from the code they describe."""

import re

from prometheus_client import generate_latest

from pruneops.cli import build_parser, main
from pruneops.config import PruneConfig
from pruneops.reference import metrics_page, params_page, reference_pages, stale_pages, write_pages
from pruneops.serving.app import Metrics
from pruneops.stages import STAGES
from tests.conftest import ROOT

REFERENCE = ROOT / "docs" / "reference"


def test_the_committed_reference_pages_are_current():
    stale = stale_pages(reference_pages(build_parser()), REFERENCE)
    assert stale == [], f"stale reference pages {stale}: run `pruneops reference`"


def test_check_names_a_page_that_no_longer_matches_the_code(tmp_path, capsys):
    out = tmp_path / "docs/reference"
    write_pages(reference_pages(build_parser()), out)
    assert main(["--root", str(tmp_path), "reference", "--check"]) == 0
    page = out / "params.md"
    page.write_text(page.read_text().replace("| `steps` | int | `4` |", "| `steps` | int | `5` |"))
    assert main(["--root", str(tmp_path), "reference", "--check"]) == 1
    assert "params.md is stale" in capsys.readouterr().err


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


def test_the_metrics_page_lists_every_metric_the_server_exposes():
    exposed = set(re.findall(r"^# TYPE (\w+) ", generate_latest(Metrics().registry).decode(), flags=re.MULTILINE))
    # prometheus_client adds a `<counter>_created` timestamp beside each counter: not a metric of ours.
    exposed -= {name for name in exposed if name.endswith("_created") and name[:-8] + "_total" in exposed}
    listed = set(re.findall(r"^\| `(\w+)` \|", metrics_page().text, flags=re.MULTILINE))
    assert listed == exposed and len(listed) >= 10
