# SPDX-License-Identifier: Apache-2.0
"""Which decode batches the compiled kernel is measured to run faster than
vLLM's own decode: the backend takes only those by default.

The table (``measured_buckets.json`` beside this module, shipped with the
package, possibly empty) holds one entry per GPU, model shape, kernel-source
hash and batch bucket, each taken from a GPU check report
(``scripts/device_run.py``) with the kernel's and the per-op baseline's step
times. A bucket opens only from a report whose verdict is "passed" (every
case correct, the abort check, every planted bug rejected, both sanitizers
clean), where the kernel was faster by ``margin`` over the run's measured
noise; the backend takes every batch up to the largest bucket below which
every bucket is open (a prefix, as ``DecodeBackend.accepts`` requires). A
change to anything that decides what the kernel runs (``build.
source_hash``), another GPU or another model shape finds no entry, and
decode stays on vLLM's path until a report measures it.

A verdict may come from several device calls at one source hash (the
check's parts, or a second call for the cases a deadline cut): ``combine``
merges their reports, and the merged verdict is what counts.

    python -m vllm_ext.megakernel.measured REPORT.json [REPORT.json ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from vllm_ext.model_spec import ModelSpec

TABLE = Path(__file__).with_name("measured_buckets.json")
# The per-op baseline a report must time the kernel against for its figures
# to count: vLLM's default decode as the GPU check builds it (Inductor-
# compiled pieces around attention) with split-KV paged attention, as vLLM's
# FlashAttention decode splits it (scripts/baseline/flashinfer_baseline.py).
# Reports timed against weaker baselines (eager elementwise ops; FlashInfer's
# decode without split-KV, as in the runs of 2026-11-30) open nothing.
FAIR_BASELINE = "vllm-default-split-kv"
# "Faster" means the kernel's median step is at least MIN_MARGIN plus both
# sides' spread (max - min over median of the repeated timings) below the
# baseline's: a win inside the run's own noise opens nothing.
MIN_MARGIN = 0.03
MIN_RUNS = 3


def spread(runs: list[float]) -> float:
    """Relative spread of repeated timings: (max - min) / median."""
    ordered = sorted(runs)
    return (ordered[-1] - ordered[0]) / ordered[len(ordered) // 2]


def margin(kernel_spread: float, baseline_spread: float) -> float:
    return MIN_MARGIN + kernel_spread + baseline_spread


@dataclass(frozen=True)
class Measurement:
    gpu: str  # torch.cuda.get_device_name()
    model: str  # model_key(spec)
    source_hash: str  # build.source_hash() of the kernel that ran
    batch: int
    megakernel_ms: float  # median of the repeated timings
    baseline_ms: float
    megakernel_spread: float  # spread() of the repeated timings
    baseline_spread: float
    report: str  # where the figures come from

    @property
    def margin(self) -> float:
        return margin(self.megakernel_spread, self.baseline_spread)

    @property
    def faster(self) -> bool:
        return self.megakernel_ms <= self.baseline_ms * (1 - self.margin)


def model_key(spec: ModelSpec) -> str:
    """Every field of the model's shape that the kernel is built for."""
    fields = dataclasses.asdict(spec)
    fields["dtype"] = str(spec.dtype)
    # (A quantized checkpoint's kinds left unquantized: a set, as a list.)
    text = json.dumps(fields, sort_keys=True, default=sorted)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def load(table: Path | None = None) -> list[Measurement]:
    table = table or TABLE
    if not table.exists():
        return []
    return [Measurement(**entry) for entry in json.loads(table.read_text())]


def verdict(report: dict) -> tuple[str, list[str]]:
    """A GPU check report's verdict: failed (something wrong was seen),
    incomplete (a required check did not run) or passed, with the reasons
    (scripts/device_run.py writes it; ``combine`` re-derives it)."""
    failed, missing = [], []
    for name, c in report["cases"].items():
        ok = c["correctness"].get("ok")
        if ok is False:
            failed.append(f"{name} incorrect")
        elif ok is None:  # skipped for time, or its child did not report
            missing.append(f"{name} not run ({c['correctness'].get('why')})")
    abort = report.get("abort", {}).get("ok")
    if abort is False:
        failed.append("the abort check")
    elif abort is None:
        missing.append("the abort check not run")
    planted = report.get("planted", {})
    for name, p in planted.items():
        if p.get("rejected") is None:
            missing.append(f"planted {name} not run")
        elif not p["rejected"]:
            failed.append(f"planted bug {name} passed the check")
    if not planted:
        missing.append("no planted bug in the bundle")
    for tool, r in report.get("sanitizer", {}).items():
        if r["status"] == "failed":
            failed.append(f"{tool} found errors")
        elif r["status"] != "passed":
            missing.append(f"{tool} not run ({r.get('why')})")
    if not report.get("sanitizer"):
        missing.append("no sanitizer run")
    if failed:
        return "failed", failed + missing
    return ("incomplete", missing) if missing else ("passed", [])


def _sources(report: dict) -> set[str]:
    return {b.get("source_hash") for b in report["manifest"]["builds"].values()}


def combine(reports: list[dict]) -> dict:
    """One report from several device calls of one check: the same GPU and
    one source hash across every build of every call (else ValueError).
    A part counts as passed where one call passed it and none failed it (a
    sanitizer that needed its own call); a case is the latest call's that
    ran it (one a deadline skipped is not run, not incorrect), unless an
    earlier call found it incorrect (a failure is never outvoted); the
    verdict is re-derived from the merged parts."""
    gpus = {r["gpu"] for r in reports}
    sources = set().union(*map(_sources, reports))
    if len(gpus) != 1 or len(sources) != 1:
        raise ValueError(f"reports of different GPUs or kernels: {sorted(gpus)}, "
                         f"source hashes {sorted(sources)}")  # fmt: skip
    merged: dict = {"gpu": gpus.pop(), "cases": {}, "planted": {},
                    "sanitizer": {}, "manifest": {"builds": {}},
                    "combined_from": len(reports)}  # fmt: skip
    for r in reports:
        merged["manifest"]["builds"].update(r["manifest"]["builds"])
        for name, case in r["cases"].items():
            old = merged["cases"].get(name)
            if old is None or old["correctness"].get("ok") is not False:
                merged["cases"][name] = case
        abort = r.get("abort", {}).get("ok")
        if abort is not None and merged.get("abort", {}).get("ok") is not False:
            merged["abort"] = r["abort"]
        for name, p in r.get("planted", {}).items():
            old = merged["planted"].get(name, {}).get("rejected")
            if old is None or (old and p.get("rejected") is False):
                merged["planted"][name] = p
        for tool, result in r.get("sanitizer", {}).items():
            old = merged["sanitizer"].get(tool, {}).get("status")
            if old in (None, "not run") or result["status"] == "failed":
                merged["sanitizer"][tool] = result
    merged["verdict"], merged["why"] = verdict(merged)
    return merged


def measurements_from_report(report: dict, name: str) -> list[Measurement]:
    """The default kernel's cases of a GPU check report (``MODEL-bN``; the
    variants are other kernels) whose verdict is "passed" and that were
    timed, repeatedly, against the fair baseline. An incomplete or failed
    check (a required part did not run, a planted bug passed, a sanitizer
    found errors, a case was wrong), or none, vouches for no figure. A case
    run with its model's first layers only (the mixtures: timing's
    "layers") counts for the model: its layers are alike, and kernel and
    baseline ran the same ones."""
    import torch

    from vllm_ext.configs import NAMES
    from vllm_ext.megakernel.plan import load_spec

    found: list[Measurement] = []
    if report.get("verdict") != "passed" or verdict(report)[0] != "passed":
        return found
    for case, entry in report.get("cases", {}).items():
        match = re.fullmatch(r"(.+)-b(\d+)", case)
        timing = entry.get("timing") or {}
        kernel_runs = timing.get("megakernel_runs_ms") or []
        baseline_runs = timing.get("per_op_graph_runs_ms") or []
        if (
            match is None
            or match.group(1) not in NAMES
            or not entry.get("correctness", {}).get("ok")
            or timing.get("per_op_baseline") != FAIR_BASELINE
            or min(len(kernel_runs), len(baseline_runs)) < MIN_RUNS
        ):
            continue
        build = report["manifest"]["builds"][case]
        found.append(
            Measurement(
                gpu=report["gpu"],
                model=model_key(load_spec(match.group(1), torch.bfloat16)),
                source_hash=build["source_hash"],
                batch=int(match.group(2)),
                megakernel_ms=statistics.median(kernel_runs),
                baseline_ms=statistics.median(baseline_runs),
                megakernel_spread=spread(kernel_runs),
                baseline_spread=spread(baseline_runs),
                report=name,
            )
        )
    return found


def record(
    report_paths: Path | list[Path], table: Path | None = None
) -> list[Measurement]:
    """Add a check's measurements to the table (one report, or the reports
    of one check's calls: ``combine``); a newer one replaces an entry for
    the same GPU, model, kernel and batch."""
    paths = [report_paths] if isinstance(report_paths, Path) else report_paths
    reports = [json.loads(p.read_text()) for p in paths]
    report = reports[0] if len(reports) == 1 else combine(reports)
    new = measurements_from_report(report, "+".join(p.name for p in paths))
    key = lambda m: (m.gpu, m.model, m.source_hash, m.batch)  # noqa: E731
    kept = {key(m): m for m in load(table)}
    kept.update({key(m): m for m in new})
    entries = sorted(kept.values(), key=key)
    (table or TABLE).write_text(
        json.dumps([dataclasses.asdict(m) for m in entries], indent=1)
    )
    return new


def max_batch(
    gpu: str, spec: ModelSpec, source_hash: str, table: Path | None = None
) -> tuple[int, str]:
    """The largest batch the kernel takes by default, and why, for the log."""
    key = model_key(spec)
    mine = {
        m.batch: m
        for m in load(table)
        if (m.gpu, m.model, m.source_hash) == (gpu, key, source_hash)
    }
    where = f"{gpu}, this model's shape, kernel sources {source_hash}"
    if not mine:
        return 0, f"no GPU check report measured this kernel ({where})"
    taken, bucket = 0, 1
    while bucket in mine and mine[bucket].faster:
        taken, bucket = bucket, bucket * 2
    shown = ", ".join(
        f"batch {b}: {m.megakernel_ms:.3f} vs {m.baseline_ms:.3f} ms "
        f"(margin {m.margin:.0%})"
        for b, m in sorted(mine.items())
    )
    return taken, f"measured ({where}; {shown}; {mine[min(mine)].report})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", type=Path, nargs="+")
    parser.add_argument("--table", type=Path, default=TABLE)
    args = parser.parse_args(argv)
    new = record(args.reports, args.table)
    for m in new:
        said = "faster" if m.faster else "not faster"
        print(f"{m.gpu} batch {m.batch}: {m.megakernel_ms:.3f} ms vs "
              f"{m.baseline_ms:.3f} ms ({said} by the {m.margin:.0%} "
              "margin)")  # fmt: skip
    if not new:
        print("nothing recorded: the verdict is not 'passed', or no case was "
              f"timed repeatedly against {FAIR_BASELINE!r}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
