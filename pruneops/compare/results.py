"""The results page and the README's headline table, built from the workload reports.

`pruneops bench` writes each workload's report to `docs/results/<bench file>/<workload>/`
(`report.md`, `results.json`, plots); a rerun replaces it and git keeps the history. This module
reads every `results.json` there and writes one row per workload: where and when it ran, the point
selected on validation, its test accuracy change with its confidence interval and its measured
speed-up. `pruneops reference` writes the page and the README's table and `--check` fails when
either is stale.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pruneops.compare.report import REPORT, RESULTS
from pruneops.core.io import read_json
from pruneops.core.quality import DenseShips, beyond_corpus

RESULTS_DIR = "results"  # under docs/
HEADLINE_START = "<!-- results:start: written by `pruneops reference` from docs/results -->"
HEADLINE_END = "<!-- results:end -->"


@dataclass(frozen=True)
class WorkloadResult:
    """One workload's current report, as its `results.json` gives it."""

    bench: str  # the bench file's stem (benchmarks/<bench>.yaml)
    workload: str
    report: Path  # relative to docs/
    command: str
    cpu: str
    date: str
    budget_points: float | None
    selected: dict | None
    decoder: dict | None = None  # a decoder workload's pick (`pruneops bench-decoder`), or {} for none
    dense_form: str = "int8"  # the precision dense ships in (its variant's deployed row): what "vs dense" means

    def cells(self, link_prefix: str) -> list[str]:
        """The table row: workload, machine and date, selected point, accuracy, speed-ups."""
        link = f"[{self.bench} / {self.workload}]({link_prefix}{self.report.as_posix()})"
        where = f"{self.cpu}, {self.date}"
        if self.decoder is not None:
            return [link, where, *_decoder_cells(self.decoder)]
        pick = self.selected
        if pick is None:
            budget = f"{self.budget_points:g} pt" if self.budget_points is not None else "the budget"
            return [link, where, f"none within {budget} on validation", "–", "–", "–"]
        low_high = pick.get("test_delta_ci_points")
        interval = f" [{low_high[0]:+.2f}, {low_high[1]:+.2f}]" if low_high else ""
        deployed = pick.get("speedup_b1_vs_dense_deployed")
        dense_ships = DenseShips.of_row(pick)  # the pick's quantize stage shipped dense: say whose model it is
        return [
            link,
            where,
            _picked(pick["name"], _form(pick["precision"], "genai") if dense_ships else "", dense_ships),
            f"{-pick['test_drop_points']:+.2f}{interval}",
            f"{pick['speedup_b1']:.2f}×"
            + (f" ({deployed:.2f}× vs dense {_form(self.dense_form, 'genai')})" if deployed else ""),
            f"{pick['mac_reduction']:.2f}×",
        ]


def _decoder_pick(data: dict) -> dict | None:
    """A decoder report's pick with its row's speed-up against dense as deployed (None for a classifier's report)."""
    if "decoder_selected" not in data:
        return None
    pick = data.get("decoder_selected")
    if not pick:  # none within the budget
        return {}
    rows = data.get("rows", [])
    fastest = next((r for r in rows if r.get("fastest_dense")), None)
    deployed = next((r for r in rows if r.get("family") == "dense" and r.get("deployed")), {})
    # Every row's "vs dense as deployed" is against dense's own pick, in its form.
    against = {"form": _form(deployed.get("precision", "int8"), deployed.get("runtime", "genai"))}
    if fastest is not None:  # the fastest dense form within the budgets: what a user who never pruned deploys
        against |= {"fastest_dense": f"{fastest['precision']} ({fastest.get('runtime', 'genai')})",
                    "fastest_is_deployed": fastest.get("name") == deployed.get("name")}  # fmt: skip
    alone = data.get("decoder_in_domain")
    in_domain = {"in_domain": {**_decoder_row(data, alone), **against}} if alone else {}
    return {**_decoder_row(data, pick), **against, **in_domain}


def _decoder_row(data: dict, pick: dict) -> dict:
    """`pick` (with its speed-up over dense Q4_K_M) and its row's speed-ups against dense as deployed and fastest."""
    row = next((r for r in data.get("rows", []) if r.get("name") == pick["name"]), {})
    keys = ("general_change", "zero_shot_change", "speedup_b1_vs_dense_deployed", "speedup_b1_vs_fastest_dense")
    figures = {key: row[key] for key in keys if row.get(key)}
    shipped = _form(row.get("precision", "int8"), row.get("runtime", "genai"))
    dense_ships = DenseShips.of_row(row)
    return {**figures, "shipped": shipped, "backed_off": bool(dense_ships), "dense_ships": dense_ships, **pick}


def _picked(name: str, form: str, dense_ships: DenseShips | None) -> str:
    """`ours deployed`, and where the pick's quantize stage shipped dense, whose model and why: ` (dense INT8: …)`."""
    return f"`{name}`" + (f" (dense {form}: {dense_ships.for_a_selection})" if dense_ships else "")


def _decoder_cells(pick: dict) -> list[str]:
    """A decoder's pick: perplexity change instead of accuracy, decode (per-token) speed-up."""
    if not pick:
        return ["none within the perplexity budget on validation", "–", "–", "–"]
    dense_ships = DenseShips.read(pick.get("dense_ships")) if pick["backed_off"] else None
    name = _picked(pick["name"], pick["shipped"], dense_ships)
    alone = pick.get("in_domain")
    speed = _decoder_speed(pick) + (
        f"; within the in-domain budget alone `{alone['name']}` {_decoder_speed(alone)}, test perplexity "
        f"{_perplexity(alone)}{beyond_corpus(alone)}"
        if alone
        else ""
    )
    return [name, f"perplexity {_perplexity(pick)}" + beyond_corpus(pick), speed, "–"]


def _form(precision: str, runtime: str) -> str:
    """`INT8` (genai, the default runtime; ONNX Runtime for a classifier), `Q4_K_M in llama.cpp`."""
    where = {"genai": "", "llamacpp": " in llama.cpp"}.get(runtime, f" in {runtime}")
    return precision.upper() + where


def _perplexity(pick: dict) -> str:
    low, high = pick["test_ratio_ci"]
    return f"{100 * (pick['test_ratio'] - 1):+.1f} % [{100 * (low - 1):+.1f}, {100 * (high - 1):+.1f}]"


def _decoder_speed(pick: dict) -> str:
    """`3.93× per generated token (1.64× vs dense INT8) (1.20× vs dense Q4_K_M in llama.cpp)`."""
    against = [
        f" ({pick[key]:.2f}× vs dense {what})"
        for key, what in (
            ("speedup_b1_vs_dense_deployed", pick["form"]),
            ("speedup_b1_vs_fastest_dense", f"{pick.get('fastest_dense')}, the fastest within the budgets"),
            ("speedup_b1_vs_q4_k_m", _form("q4_k_m", "llamacpp")),
        )
        if pick.get(key) and not (key == "speedup_b1_vs_fastest_dense" and pick.get("fastest_is_deployed"))
    ]
    return f"{pick['speedup_b1']:.2f}× per generated token" + "".join(against)


HEADER = [
    "| workload | machine, date | selected (on validation) | Δ test acc. (pts) or perplexity [95% CI] "
    "| batch-1 speed-up vs dense fp32 | fewer MACs |",
    "|---|---|---|---|---|---|",
]


def read_results(docs: Path) -> list[WorkloadResult]:
    """Every workload report under `docs/results`, sorted by bench file and workload."""
    found = []
    for path in sorted((Path(docs) / RESULTS_DIR).glob(f"*/*/{RESULTS}")):
        data = read_json(path)
        machine = data.get("machine", {})
        found.append(
            WorkloadResult(
                bench=path.parent.parent.name,
                workload=data.get("workload", path.parent.name),
                report=(path.parent / REPORT).relative_to(docs),
                command=data.get("command", ""),
                cpu=_short_cpu(machine.get("cpu", "unknown CPU")),
                date=machine.get("date", "undated"),
                budget_points=data.get("budget_points"),
                selected=data.get("selected"),
                decoder=_decoder_pick(data),
                dense_form=_dense_form(data.get("rows", [])),
            )
        )
    return found


def _dense_form(rows: list[dict]) -> str:
    """The precision of dense's deployed row (`int8` where a report has none: dense shipped INT8 then)."""
    return next((r["precision"] for r in rows if r.get("family") == "dense" and r.get("deployed")), "int8")


def _short_cpu(name: str) -> str:
    """`AMD EPYC 7B13 64-Core Processor` -> `AMD EPYC 7B13`: the model, not the marketing."""
    return re.sub(r"\s+(\d+-Core\s+)?Processor$|\(R\)|\(TM\)", "", name).strip()


def results_page(docs: Path) -> str:
    """`docs/results.md`: every workload's current report in one table, with how to rerun each."""
    results = read_results(docs)
    lines = [
        "<!-- Generated by `pruneops reference` from docs/results/*/*/results.json: rerun a workload, then it. -->",
        "",
        "# Results",
        "",
        "One current report per workload: `pruneops bench --config benchmarks/<bench>.yaml` reruns a bench",
        "file and replaces its workloads' reports (git keeps the earlier ones). Each report gives the",
        "command, the machine, every variant's quality and measured latency, and the point selected on",
        "**validation**: the fastest of ours whose quality holds the workload's budget at the far end of its",
        "95 % paired interval, with its test figures as they came (a report says where test disagrees).",
        "Speed-ups are measured on the CPU named (ONNX Runtime, or onnxruntime-genai for a decoder), all",
        "models of a workload timed interleaved in one process; compare them within a row, not across machines.",
        "",
        *HEADER,
        *("| " + " | ".join(r.cells("")) + " |" for r in results),
        "",
        "Commands, one per bench file:",
        "",
        *sorted({f"- `{r.command}`" for r in results if r.command}),
        "",
        "One-off measurements (GPU latency of pruned checkpoints and 2:4 sparsity, the sensitivity sweep on a",
        "Ray cluster, the decoder recovery and vocabulary studies) are studies, each a script and its result:",
        "`studies/` in the repository.",
        "",
    ]
    return "\n".join(lines)


def headline_table(docs: Path, link_prefix: str = "docs/") -> str:
    """The README's table: the same rows, linked from the repository root."""
    rows = ["| " + " | ".join(r.cells(link_prefix)) + " |" for r in read_results(docs) if r.selected or r.decoder]
    return "\n".join([HEADLINE_START, *HEADER, *rows, HEADLINE_END])


def with_headline(readme: str, table: str) -> str:
    """`readme` with the text between the markers replaced by `table`.

    Raises:
        ValueError: The README lacks the markers.
    """
    start, end = readme.find(HEADLINE_START), readme.find(HEADLINE_END)
    if start < 0 or end < start:
        raise ValueError(f"README.md: no {HEADLINE_START!r} ... {HEADLINE_END!r} block to write the results into")
    return readme[:start] + table + readme[end + len(HEADLINE_END) :]
