"""Write docs/README.md: one line per benchmark report under docs/, newest first.

Each `pruneops bench` report (`docs/<dir>/benchmarks.md`) starts with the command that made it
and the machine and date it ran on; this collects those, with each workload's selected point (or
that none was within its budget), so a reader can find the run behind a figure without opening
seventy files. Folders without a bench report (docs/gpu, docs/text-fisher, ...) are listed with
their own README. Run from the repository root: `python scripts/index_reports.py`.
"""

import re
from pathlib import Path

DOCS = Path("docs")
SELECTED = re.compile(r"^\*\*Selected\*\* \([^)]*\): (.*?): test ([\d.]+%) \(([-+\d.]+) pts.*?batch-1 ([\d.]+×) faster")


def _report_line(path: Path) -> tuple[str, str]:
    """(date, markdown row) for one bench report."""
    text = path.read_text()
    command = re.search(r"^Reproduce: `(.*)`", text, re.M)
    machine = re.search(r"^Machine: ([^;]*);.*?(\d{4}-\d{2}-\d{2})\.", text, re.M)
    date = machine.group(2) if machine else "?"
    workloads = []
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        name = section.split("\n", 1)[0].strip()
        picked = next(filter(None, map(SELECTED.match, section.splitlines())), None)
        if picked:
            row, test, drop, speedup = picked.groups()
            workloads.append(f"{name}: {row}, {test} ({drop} pt), {speedup} b1")
        elif "No structured model stayed within" in section:  # bench_report's line when nothing is selected
            workloads.append(f"{name}: no point within budget")
        else:
            workloads.append(name)
    target = path.relative_to(DOCS).as_posix()
    link = f"[{target.removesuffix('/benchmarks.md')}]({target})"
    cells = [link, date, machine.group(1) if machine else "?", f"`{command.group(1)}`" if command else "?"]
    return date, "| " + " | ".join(cells + ["<br>".join(workloads)]) + " |"


def main() -> None:
    """Index every `docs/*/benchmarks.md` (and `docs/benchmarks.md`) into `docs/README.md`."""
    reports = sorted(DOCS.glob("*/benchmarks.md")) + [DOCS / "benchmarks.md"]
    rows = sorted((_report_line(p) for p in reports), key=lambda r: r[0], reverse=True)
    others = sorted(d.name for d in DOCS.iterdir() if d.is_dir() and (d / "README.md").exists())
    lines = [
        "# Benchmark reports",
        "",
        "Reference pages generated from the code (`make reference`; a test fails when one is stale):",
        "[params.yaml keys](reference/params.md), [command line](reference/cli.md),",
        "[serving metrics](reference/metrics.md), [stages](reference/stages.md).",
        "",
        "Every report of `pruneops bench` kept in this folder, newest first (written by",
        "`python scripts/index_reports.py`). Each report gives its command, machine, timing protocol and",
        "every row; the selected point is the fastest model whose *validation* drop is within the",
        "workload's budget, with its test figures as they came. Milliseconds differ from machine to",
        "machine and from day to day on the same VM: compare ratios within one report.",
        "[pruning-for-milliseconds.md](pruning-for-milliseconds.md) and [pretrained-vision.md](pretrained-vision.md)",
        "tell what each run was for.",
        "",
        "| report | date | machine | command | selected point per workload |",
        "|---|---|---|---|---|",
        *(row for _, row in rows),
        "",
        "Measured outside `pruneops bench`, each with its own README: "
        + ", ".join(f"[{name}]({name}/README.md)" for name in others)
        + ".",
        "",
    ]
    (DOCS / "README.md").write_text("\n".join(lines))
    print(f"docs/README.md: {len(rows)} reports, {len(others)} other folders")


if __name__ == "__main__":
    main()
