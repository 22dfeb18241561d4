# SPDX-License-Identifier: Apache-2.0
"""Which decode batches the compiled kernel is measured to run faster than
vLLM's own decode: the backend takes only those by default.

The table (``measured_buckets.json`` beside this module, shipped with the
package, possibly empty) holds one entry per GPU, model shape, kernel-source
hash and batch bucket, each taken from a GPU check report
(``scripts/device_run.py``) with the kernel's and the per-op baseline's step
times. A bucket opens when the kernel was correct and faster there; the
backend takes every batch up to the largest bucket below which every bucket
is open (a prefix, as ``DecodeBackend.accepts`` requires). A change to the
kernel's sources, another GPU or another model shape finds no entry, and
decode stays on vLLM's path until a report measures it.

    python -m vllm_ext.megakernel.measured REPORT.json   # record a report
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
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


@dataclass(frozen=True)
class Measurement:
    gpu: str  # torch.cuda.get_device_name()
    model: str  # model_key(spec)
    source_hash: str  # build.source_hash() of the kernel that ran
    batch: int
    megakernel_ms: float
    baseline_ms: float
    report: str  # where the figures come from

    @property
    def faster(self) -> bool:
        return self.megakernel_ms < self.baseline_ms


def model_key(spec: ModelSpec) -> str:
    """Every field of the model's shape that the kernel is built for."""
    fields = dataclasses.asdict(spec)
    fields["dtype"] = str(spec.dtype)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def load(table: Path | None = None) -> list[Measurement]:
    table = table or TABLE
    if not table.exists():
        return []
    return [Measurement(**entry) for entry in json.loads(table.read_text())]


def measurements_from_report(report: dict, name: str) -> list[Measurement]:
    """The default kernel's cases of a GPU check report (``MODEL-bN``; the
    variants are other kernels) that passed their correctness check and were
    timed against the fair baseline. A report whose check failed (a
    planted bug passed, a sanitizer found errors, a case was wrong), or that
    has no verdict, vouches for no figure. A case run with its model's
    first layers only (the mixtures: timing's "layers") counts for the
    model: its layers are alike, and kernel and baseline ran the same ones."""
    import torch

    from vllm_ext.configs import NAMES
    from vllm_ext.megakernel.plan import load_spec

    found: list[Measurement] = []
    if report.get("verdict") not in ("passed", "incomplete"):
        return found
    for case, entry in report.get("cases", {}).items():
        match = re.fullmatch(r"(.+)-b(\d+)", case)
        timing = entry.get("timing") or {}
        if (
            match is None
            or match.group(1) not in NAMES
            or not entry.get("correctness", {}).get("ok")
            or timing.get("per_op_baseline") != FAIR_BASELINE
            or not timing.get("megakernel_ms")
            or not timing.get("per_op_graph_ms")
        ):
            continue
        build = report["manifest"]["builds"][case]
        found.append(
            Measurement(
                gpu=report["gpu"],
                model=model_key(load_spec(match.group(1), torch.bfloat16)),
                source_hash=build["source_hash"],
                batch=int(match.group(2)),
                megakernel_ms=float(timing["megakernel_ms"]),
                baseline_ms=float(timing["per_op_graph_ms"]),
                report=name,
            )
        )
    return found


def record(report_path: Path, table: Path | None = None) -> list[Measurement]:
    """Add a report's measurements to the table; a newer one replaces an
    entry for the same GPU, model, kernel and batch."""
    new = measurements_from_report(
        json.loads(report_path.read_text()), report_path.name
    )
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
        f"batch {b}: {m.megakernel_ms:.3f} vs {m.baseline_ms:.3f} ms"
        for b, m in sorted(mine.items())
    )
    return taken, f"measured ({where}; {shown}; {mine[min(mine)].report})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--table", type=Path, default=TABLE)
    args = parser.parse_args(argv)
    new = record(args.report, args.table)
    for m in new:
        verdict = "faster" if m.faster else "slower"
        print(f"{m.gpu} batch {m.batch}: {m.megakernel_ms:.3f} ms vs "
              f"{m.baseline_ms:.3f} ms ({verdict})")  # fmt: skip
    if not new:
        print(f"no case of {args.report} was timed against {FAIR_BASELINE!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
