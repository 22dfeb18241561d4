# SPDX-License-Identifier: Apache-2.0
"""The docs' claims, held to where they come from.

* docs/perf.md holds measurements only. Its ``## `` sections are of two
  kinds, by their heading: ``GPU ...`` and ``CPU ...``; any other section
  (the page's introduction) holds no figure. In a GPU section every block
  (a paragraph, a list, a table) with a time or a throughput in it, and
  every table, names a report file in docs/gpu-runs/ that exists: in the
  block itself or, for a table, in the block right before it (its
  caption); each ``### `` run names its GPU, date, commit and baseline. In
  a CPU section (measured in CPU reference mode, or builds on a CPU) each
  ``### `` heading names the commit it ran at. No line with a figure in
  perf.md says "predict".
* No text says a target is met by a prediction (README.md, CONTRIBUTING.md,
  docs/*.md): no line with "met"/"meets" and "predict" or "cost model", no
  paragraph with "target", a claim of reaching it ("met", "meets",
  "reached", "within the N% target") and "predict" or "model".
* docs/predictions.md: every line with a time (ms, us) says "predicted",
  or sits in a table whose header says it; the first section states the
  model's measured error, with the report it was measured in.
* README.md is at most 160 lines.

Each rule is a function of the text, so the tests below also show each one
failing on a planted violation.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README_MAX_LINES = 160

# A time or a throughput: a number and its unit, or an "x" speed-up.
_UNIT = r"(?:ms|us|µs|μs|ns|s|min|GB/s|TB/s|tok/s)"
FIGURE = re.compile(rf"\d(?:[\d,.]*\d)?\s?{_UNIT}(?![\w/])|\b\d+(?:\.\d+)?x\b")
# A unit standing alone in a table header ("| megakernel ms |").
HEADER_UNIT = re.compile(rf"(?<![\w'’]){_UNIT}(?![\w/])")
TIME = re.compile(r"\d(?:[\d,.]*\d)?\s?(?:ms|us|µs|μs)(?![\w/])")
TIME_UNIT = re.compile(r"(?<![\w'’])(?:ms|us|µs|μs)(?![\w/])")
REPORT = re.compile(r"gpu-runs/([\w.-]+\.json)")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
GPU_NAME = re.compile(r"\b(?:H100|H200|B200|GB200|A100)\b")
# What each GPU run in perf.md names.
RUN_FACTS = (
    ("GPU", GPU_NAME),
    ("date", DATE),
    ("commit", COMMIT),
    ("baseline", re.compile("baseline", re.I)),
)

MET_LINE = re.compile(r"\bmeets?\b|\bmet\b", re.I)
PREDICT_LINE = re.compile(r"predict|cost model", re.I)
TARGET = re.compile(r"\btargets?\b", re.I)
CLAIM = re.compile(r"\b(?:met|meets|reached|reaches)\b|within the \d+\s?% target", re.I)
PREDICT_OR_MODEL = re.compile(r"predict|\bmodel\b", re.I)


def blocks(text: str) -> list[tuple[int, list[str]]]:
    """Runs of non-blank lines, outside fenced code, with their first line's
    number (1-based)."""
    out: list[tuple[int, list[str]]] = []
    current: list[str] = []
    start = 0
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or not line.strip():
            if current:
                out.append((start, current))
                current = []
            continue
        if not current:
            start = number
        current.append(line)
    if current:
        out.append((start, current))
    return out


def is_table(block: list[str]) -> bool:
    return all(line.lstrip().startswith("|") for line in block)


def sections(text: str, level: str) -> list[tuple[str, str]]:
    """(heading, body) of each section at ``level`` ("## " or "### "); the
    text before the first one under the heading ""."""
    out = [["", []]]
    for line in text.splitlines():
        if line.startswith(level):
            out.append([line[len(level) :].strip(), []])
        else:
            out[-1][1].append(line)
    return [(heading, "\n".join(body)) for heading, body in out]


def has_figure(block: list[str]) -> bool:
    if any(FIGURE.search(line) for line in block):
        return True
    return is_table(block) and bool(HEADER_UNIT.search(block[0]))


def perf_problems(text: str, reports: set[str]) -> list[str]:
    """What in perf.md's ``text`` breaks its rules; ``reports``: the file
    names in docs/gpu-runs/."""
    problems = []
    for name in REPORT.findall(text):
        if name not in reports:
            problems.append(f"names gpu-runs/{name}, which does not exist")
    for number, line in enumerate(text.splitlines(), 1):
        if FIGURE.search(line) and re.search("predict", line, re.I):
            problems.append(f"line {number}: a prediction: {line.strip()[:70]}")
    for heading, body in sections(text, "## "):
        where = f"section {heading or '(introduction)'!r}"
        parts = blocks(body)
        if heading.startswith("GPU"):
            for i, (_, block) in enumerate(parts):
                if not (has_figure(block) or is_table(block)):
                    continue
                cited = set(REPORT.findall("\n".join(block)))
                if is_table(block) and i > 0 and not is_table(parts[i - 1][1]):
                    cited |= set(REPORT.findall("\n".join(parts[i - 1][1])))
                if not cited & reports:
                    problems.append(
                        f"{where}: names no report in gpu-runs/: {block[0][:70]}"
                    )
            for run, run_body in sections(body, "### ")[1:]:
                run_text = f"{run}\n{run_body}"
                for what, pattern in RUN_FACTS:
                    if not pattern.search(run_text):
                        problems.append(f"{where}, {run!r}: names no {what}")
        elif heading.startswith("CPU"):
            for run, _ in sections(body, "### ")[1:]:
                if not COMMIT.search(run):
                    problems.append(f"{where}, {run!r}: the heading names no commit")
        else:
            for _, block in parts:
                if has_figure(block):
                    problems.append(
                        f"{where} is neither GPU nor CPU, yet has a figure: "
                        f"{block[0][:70]}"
                    )
    return problems


def target_claims(text: str) -> list[str]:
    """Where ``text`` says a target is met by a prediction."""
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        if MET_LINE.search(line) and PREDICT_LINE.search(line):
            problems.append(f"line {number}: {line.strip()[:70]}")
    for start, block in blocks(text):
        joined = " ".join(block)
        if all(p.search(joined) for p in (TARGET, CLAIM, PREDICT_OR_MODEL)):
            problems.append(f"paragraph at line {start}: {block[0].strip()[:70]}")
    return problems


def prediction_problems(text: str, reports: set[str]) -> list[str]:
    """Times in predictions.md not labelled "predicted"; the first section
    must state the model's measured error, with its report."""
    problems = []
    for _, block in blocks(text):
        labelled_table = is_table(block) and "predicted" in block[0].lower()
        for offset, line in enumerate(block):
            in_table_body = is_table(block) and offset > 0
            timed = TIME.search(line) or (
                in_table_body and TIME_UNIT.search(block[0]) and re.search(r"\d", line)
            )
            if not timed or labelled_table:
                continue
            if "predicted" not in line.lower():
                problems.append(f"not labelled predicted: {line.strip()[:70]}")
    first = sections(text, "## ")[1:2]
    if not first:
        problems.append("no section")
    else:
        heading, body = first[0]
        cited = set(REPORT.findall(body)) & reports
        if "error" not in heading.lower() or "measured" not in body or not cited:
            problems.append(
                "the first section does not state the model's measured error "
                "with its report in gpu-runs/"
            )
    return problems


def _reports() -> set[str]:
    return {p.name for p in (DOCS / "gpu-runs").iterdir()}


def _prose_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(DOCS.glob("*.md"))]


def test_perf_holds_measurements_with_their_reports():
    assert perf_problems((DOCS / "perf.md").read_text(), _reports()) == []


@pytest.mark.parametrize("path", _prose_files(), ids=lambda p: p.name)
def test_no_target_is_met_by_a_prediction(path):
    assert target_claims(path.read_text()) == []


def test_predictions_are_labelled():
    assert prediction_problems((DOCS / "predictions.md").read_text(), _reports()) == []


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES


REPORTS = {"2026-11-30-h200-42d7577.json"}
GOOD_RUN = """\
## GPU

### H200, 2026-11-30, commit 42d7577

Baseline: vLLM's default decode. Report: gpu-runs/2026-11-30-h200-42d7577.json.

| case | megakernel ms |
| --- | --- |
| 1B, 1 | 1.457 |
"""


def test_each_perf_rule_fails_on_its_violation():
    assert perf_problems(GOOD_RUN, REPORTS) == []
    uncited = GOOD_RUN.replace("Report: gpu-runs/2026-11-30-h200-42d7577.json.", "")
    assert any("names no report" in p for p in perf_problems(uncited, REPORTS))
    missing = GOOD_RUN.replace("42d7577.json", "1234abc.json")
    assert any("does not exist" in p for p in perf_problems(missing, REPORTS))
    no_baseline = GOOD_RUN.replace("Baseline: vLLM's default decode. ", "")
    assert any("names no baseline" in p for p in perf_problems(no_baseline, REPORTS))
    loose = "Intro: the step took 1.4 ms.\n\n" + GOOD_RUN
    assert any("neither GPU nor CPU" in p for p in perf_problems(loose, REPORTS))
    predicted = GOOD_RUN + "\nThe model predicted 0.706 ms (gpu-runs/x.json).\n"
    assert any("a prediction" in p for p in perf_problems(predicted, REPORTS))
    cpu = "## CPU reference mode\n\n### `vllm bench serve`\n\n| s | tok/s |\n"
    assert any("names no commit" in p for p in perf_problems(cpu, REPORTS))
    assert perf_problems(cpu.replace("serve`", "serve`, dd65c2a"), REPORTS) == []


def test_target_claims_are_caught():
    assert target_claims("The 1B target is met by the model at 1 us.") != []
    assert target_claims("Llama-3.2-1B is within the 15% target.\nThe model") != []
    assert target_claims("predicted: 0.59 ms, met at 1 us") != []
    assert target_claims("The wait is met; the cost of a poll.") == []
    assert target_claims("Speed targets are GPU targets, judged on a GPU.") == []


def test_unlabelled_predictions_are_caught():
    good = (
        "## The model's measured error\n\n"
        "Predicted 0.706 ms; measured 1.457 ms "
        "(gpu-runs/2026-11-30-h200-42d7577.json).\n"
        "\n| case | predicted ms |\n| --- | --- |\n| 1B | 0.6 |\n"
    )
    assert prediction_problems(good, REPORTS) == []
    bare = good.replace("| case | predicted ms |", "| case | ms |")
    assert prediction_problems(bare, REPORTS) != []
    prose = good + "\nQKV then takes 0.15 ms.\n"
    assert prediction_problems(prose, REPORTS) != []
    unstated = good.replace("measured 1.457 ms ", "")
    assert prediction_problems(unstated, REPORTS) != []
