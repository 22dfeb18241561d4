# SPDX-License-Identifier: Apache-2.0
"""The cost model's device figures from a GPU check's report.

    python -m vllm_ext.megakernel.calibrate docs/gpu-runs/REPORT.json \
        [--carry KINDS] [--json]

For each timed case (``scripts/device_run.py``'s report), from the programs
its breakdown ran, re-planned here:

* the instruction overhead: the all-NOP program's time over its longest
  queue (every SM walks its queue, no waits);
* the dependency latency, when the report has the waits probe (every
  instruction a NOP, the waits and signals kept): the latency that makes
  the model's time for that probe the measured one;
* what a phase boundary costs in the real step: the step minus the step
  without waits, over the phases that wait;
* per kind of instruction that has a breakdown row (the kind alone, no
  waits), what executing it costs per byte it moves beyond the stream
  (``Device.exec_s_per_byte``): the figure that makes the model's time for
  that row the measured one (``solve_exec``); 0 where the stream alone
  explains it. These belong to the case's kernel and batch (the CUDA-core
  or the tensor-core GEMV, one attention or the other), so they stay with
  the fit and never go into ``DEVICES``;
* the model's step, and its step without waits, with those figures, the
  report's copy bandwidth and the case's kernel's own lookahead
  (``kernel_lookahead_bytes``; the device's, which the weight pipeline was
  designed against, for reports that do not record the kernel), beside the
  measured ones. The step without waits is the rows put back together: how
  well the model composes what it was fitted on;
* what those figures predict for the kernel this checkout builds for the
  case's model and batch (``predict_this_kernel``, default cases only: the
  default program, that kernel's lookahead), at 1, 2 and 5 us per
  dependency, keeping the execution figures of the kinds ``--carry``
  names: those whose code has not changed since the report's commit (a
  figure belongs to the kernel that ran).

The all-NOP time is divided by the longest queue of the program that ran:
reports record its queue lengths (older ones have them in a side file,
``REPORT.queues.json``, planned at the report's commit). The rest is
modelled on the program this checkout plans, at the context the case ran
(its attention's bytes): the waits probe is solved only when that is the
program that ran (run it at the report's commit otherwise), the predicted
step is this checkout's program's, and a report that records its
programs' digests (since 2026-12-02) is refused case by case where the
program planned here is another. A case of a program no longer planned
(the fused COMBINE's) is skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from collections.abc import Collection
from pathlib import Path

import torch

from vllm_ext.megakernel.cost import DEVICES, Device, predict
from vllm_ext.megakernel.isa import NO_COUNTER, Op
from vllm_ext.megakernel.planner import Program, plan
from vllm_ext.model_spec import ModelSpec

CASE = re.compile(r"^(?P<config>.+)-b(?P<batch>\d+)(?:-(?P<variant>[a-z]+))?$")
# Latencies the solver searches (seconds).
MAX_LATENCY_S = 50e-6
# A breakdown row this close to the all-NOP row is the walk alone.
NOISE = 0.02
# The latencies per dependency every prediction is stated at (issue 16), us.
LATENCIES_US = (1, 2, 5)


def probe(program: Program, keep=None, waits: bool = True) -> Program:
    """A timing probe of the GPU check's breakdown (its results are
    garbage): every instruction whose opcode is not in ``keep`` made a NOP
    (``keep=None``: none), and without the waits unless ``waits``. Signals
    are kept, so every counter still counts what the waits expect."""

    def change(i):
        if keep is not None and i.op not in keep:
            i = dataclasses.replace(i, op=Op.NOP)
        if not waits:
            i = dataclasses.replace(i, wait_counter=NO_COUNTER, wait_count=0)
        return i

    return dataclasses.replace(
        program, queues=tuple(tuple(change(i) for i in q) for q in program.queues)
    )


def phases(program: Program) -> int:
    """Phases that wait: distinct (opcode, layer) among the instructions
    with a wait."""
    return len(
        {(i.op, i.layer) for q in program.queues for i in q
         if i.wait_counter != NO_COUNTER}
    )  # fmt: skip


def solve_latency(program: Program, device: Device, measured_s: float) -> float | None:
    """The dependency latency at which the model's time for the waits probe
    of ``program`` is ``measured_s`` (None: not within [0, MAX_LATENCY_S])."""
    chained = probe(program, keep=())

    def step(latency: float) -> float:
        d = dataclasses.replace(device, dependency_latency_s=latency)
        return predict(chained, d).step_s

    lo, hi = 0.0, MAX_LATENCY_S
    if not step(lo) <= measured_s <= step(hi):
        return None
    for _ in range(30):  # to well under a nanosecond
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if step(mid) < measured_s else (lo, mid)
    return (lo + hi) / 2


def solve_exec(program: Program, device: Device, op: Op, measured_s: float,
               lookahead: int | None = None) -> float:  # fmt: skip
    """The seconds per byte of ``op``'s instructions (``exec_s_per_byte``)
    at which the model's time for the breakdown row that runs them alone
    without waits is ``measured_s``, within 0.1%; 0 where the model's
    weight stream alone already takes that long. The other kinds' figures
    in ``device`` stay (a routed EXPERT_UP tile runs TOPK's routing)."""
    if not math.isfinite(measured_s) or measured_s <= 0:
        raise ValueError(f"{op.name}'s breakdown row is {measured_s} s")
    row = probe(program, keep=(op,), waits=False)
    others = tuple((n, c) for n, c in device.exec_s_per_byte if n != op.name)

    def step(per_byte: float) -> float:
        d = dataclasses.replace(device, exec_s_per_byte=(*others, (op.name, per_byte)))
        return predict(row, d, lookahead).step_s

    lo, t_lo = 0.0, step(0.0)
    if t_lo >= measured_s:
        return 0.0
    # The time is non-decreasing in the figure and at least the busiest
    # SM's bytes of ``op`` times it: start there and double.
    moved = max(
        sum(c.weight_bytes + c.other_bytes + c.early_bytes
            for c in (row.step_cost(i) for i in q if i.op == op))
        for q in row.queues
    )  # fmt: skip
    if not moved:
        return 0.0  # (nothing to charge it to)
    hi = (measured_s - t_lo) / moved
    t_hi = step(hi)
    while t_hi < measured_s:
        lo, t_lo, hi = hi, t_hi, 2 * hi
        t_hi = step(hi)
    # Regula falsi, Illinois: the time is piecewise linear in the figure.
    side = 0
    for _ in range(60):
        mid = lo + (hi - lo) * (measured_s - t_lo) / (t_hi - t_lo)
        t = step(mid)
        if abs(t - measured_s) <= 1e-3 * measured_s:
            return mid
        if t < measured_s:
            lo, t_lo = mid, t
            if side == -1:
                t_hi = measured_s + (t_hi - measured_s) / 2
            side = -1
        else:
            hi, t_hi = mid, t
            if side == 1:
                t_lo = measured_s - (measured_s - t_lo) / 2
            side = 1
    return (lo + hi) / 2


def kernel_lookahead_bytes(shape: dict | None) -> int | None:
    """How far ahead of its execution a kernel built for ``shape`` (a
    ``KernelShape`` as a dict) streams an SM's weights: the producer's
    shared-memory ring plus the pages it hints into L2 past it; or (the
    legacy control) the next instruction's first rows in L2, about one
    ``PREFETCH_BYTES``. None for an unknown kernel."""
    if not shape:
        return None
    from vllm_ext.megakernel.kernel.ops.prefetch import PREFETCH_BYTES
    from vllm_ext.megakernel.kernel.ops.weight_pipe import L2_AHEAD_PAGES
    from vllm_ext.megakernel.kernel.persistent import ring_slots
    from vllm_ext.megakernel.kernel.shape import PAGE_BYTES, KernelShape

    known = {f.name for f in dataclasses.fields(KernelShape)}
    if "legacy_control" not in shape:
        # Recorded before the warp roles: its default was the legacy
        # control; its staging variants no longer exist.
        if any(shape.get(n) for n in ("weight_pipe", "stage_weights")):
            return None
        shape = {**shape, "legacy_control": True}
    s = KernelShape(**{k: v for k, v in shape.items() if k in known})
    if s.legacy_control:
        return PREFETCH_BYTES
    return ring_slots(s) * PAGE_BYTES + L2_AHEAD_PAGES * PAGE_BYTES


@dataclasses.dataclass(frozen=True)
class Fit:
    case: str
    measured_ms: float
    instruction_overhead_s: float
    dependency_latency_s: float | None  # from the waits probe, if it ran
    wait_per_phase_s: float | None  # (step - step without waits) / phases
    # (opcode name, seconds per byte): the kinds with a breakdown row
    exec_s_per_byte: tuple[tuple[str, float], ...]
    predicted_ms: float  # the model with the fitted figures
    no_waits_ms: float | None  # measured, the step without waits
    predicted_no_waits_ms: float | None  # the model's, fitted figures
    # ``predict_this_kernel``: the kernel this checkout builds for the case
    # (default cases only), ms at LATENCIES_US, with the execution figures
    # of the kinds in ``carried``.
    this_kernel_ms: tuple[float, ...] | None = None
    carried: tuple[str, ...] = ()

    def exec_bytes_per_s(self, num_sms: int) -> dict[str, float | None]:
        """Per kind, the rate all SMs execute its bytes at beyond the stream
        (None: the stream alone explains its row)."""
        return {n: num_sms / c if c else None for n, c in self.exec_s_per_byte}


def case_spec(name: str, timing: dict) -> tuple[ModelSpec, int]:
    """The model (at the depth the case ran) and batch of a case."""
    m = CASE.match(name)
    if m is None:
        raise ValueError(f"{name}: not a MODEL-bBATCH[-VARIANT] case")
    from vllm_ext.megakernel.plan import load_spec

    spec = load_spec(m["config"], torch.bfloat16)
    if "layers" in timing:  # a case run with its first layers only
        spec = spec.with_layers(timing["layers"])
    return spec, int(m["batch"])


def fit_case(name: str, timing: dict, device: Device, bandwidth: float | None,
             program: Program | None = None) -> Fit | None:  # fmt: skip
    """The figures of one case (None: not timed, no all-NOP row, or a
    program no longer planned)."""
    rows = timing.get("breakdown") or {}
    if "NOP" not in rows or "megakernel_ms" not in timing:
        return None
    planned = program is not None  # by the caller: its queues are the run's
    if program is None:
        options = timing.get("program", {})  # absent before 2026-11-30's 4th run
        if options.get("fuse_combine"):  # deleted 2026-12-02 (isa.py)
            return None
        spec, batch = case_spec(name, timing)
        program = plan(spec, batch, device, with_lm_head=True,
                       qkv_parts=options.get("qkv_parts", 1),
                       combine_parts=options.get("combine_parts", 1))  # fmt: skip
    if "context" in timing:  # the attention's bytes at the run's tokens
        program = dataclasses.replace(program, context=int(timing["context"]))
    lengths = [len(q) for q in program.queues]
    ran = (timing.get("program") or {}).get("queue_lengths")
    if ran is None and not planned:
        raise ValueError(
            f"{name}: no queue lengths, in the report or in REPORT.queues.json"
        )
    ran = lengths if ran is None else ran
    digest = (timing.get("program") or {}).get("digest")  # since 2026-12-02
    if digest is not None and digest != program.digest():
        raise ValueError(
            f"{name}: the program planned here for {device.name} "
            f"({device.num_sms} SMs) is not the one that ran (its digest "
            "differs): run calibrate at the report's commit, for the GPU the "
            "bundle was planned for"
        )
    overhead = rows["NOP"]["ms"] * 1e-3 / max(ran)
    fitted = dataclasses.replace(device, instruction_overhead_s=overhead)
    if bandwidth:
        fitted = dataclasses.replace(fitted, hbm_bytes_per_s=bandwidth)
    latency = None
    if "NOP, waits" in rows:
        if ran != lengths:
            raise ValueError(
                f"{name}: the program planned here is not the one that ran: "
                "run calibrate at the report's commit"
            )
        latency = solve_latency(program, fitted, rows["NOP, waits"]["ms"] * 1e-3)
    if latency is not None:
        fitted = dataclasses.replace(fitted, dependency_latency_s=latency)
    step_ms = timing["megakernel_ms"]
    per_phase = None
    if "no waits" in rows:
        per_phase = (step_ms - rows["no waits"]["ms"]) * 1e-3 / phases(program)
    lookahead = kernel_lookahead_bytes(timing.get("shape"))
    present = {i.op for q in program.queues for i in q}
    # In opcode order, each kind fitted with the earlier kinds' figures set
    # (TOPK's before EXPERT_UP's, whose routed tiles run its routing).
    for op in Op:
        if op.name in rows and op in present:
            row_s = rows[op.name]["ms"] * 1e-3
            # A row within timing noise of the all-NOP walk (EMBED,
            # FINAL_NORM) has no execution to fit.
            quiet = row_s <= (1 + NOISE) * rows["NOP"]["ms"] * 1e-3
            c = 0.0 if quiet else solve_exec(program, fitted, op, row_s, lookahead)
            kept = [t for t in fitted.exec_s_per_byte if t[0] != op.name]
            fitted = dataclasses.replace(fitted, exec_s_per_byte=(*kept, (op.name, c)))
    no_waits = rows.get("no waits", {}).get("ms")
    predicted_no_waits = None
    if no_waits is not None:
        unwaited = probe(program, keep=None, waits=False)
        predicted_no_waits = predict(unwaited, fitted, lookahead).step_s * 1e3
    return Fit(name, step_ms, overhead, latency, per_phase, fitted.exec_s_per_byte,
               predict(program, fitted, lookahead).step_s * 1e3,
               no_waits, predicted_no_waits)  # fmt: skip


def predict_this_kernel(fit: Fit, timing: dict, device: Device,
                        bandwidth: float | None,
                        carry: Collection[str] | None = None) -> Fit:  # fmt: skip
    """``fit`` with the step it predicts for the kernel this checkout builds
    for the case's model and batch: the default program at the case's
    context, that kernel's lookahead, the fitted instruction overhead, the
    report's bandwidth, and the execution figures of the kinds ``carry``
    names (None: every fitted kind), at each of LATENCIES_US. A figure
    belongs to the kernel that ran: carry the kinds whose code is unchanged
    since the report's commit. A variant case (``-wide``, ``-heads``,
    ``-legacy``) is returned as it is: its figures are another kernel's or
    program's than the default's."""
    from vllm_ext.megakernel.kernel.shape import KernelShape
    from vllm_ext.testing import BLOCK_SIZE

    m = CASE.match(fit.case)
    if m is None or m["variant"]:
        return fit
    spec, batch = case_spec(fit.case, timing)
    program = plan(spec, batch, device, with_lm_head=True)
    if "context" in timing:
        program = dataclasses.replace(program, context=int(timing["context"]))
    # The GPU check's block size, where the report does not record one.
    block_size = (timing.get("shape") or {}).get("block_size", BLOCK_SIZE)
    shape = KernelShape.from_program(program, block_size)
    lookahead = kernel_lookahead_bytes(shape.as_dict())
    figures = tuple(
        (n, c) for n, c in fit.exec_s_per_byte if carry is None or n in carry
    )
    fitted = dataclasses.replace(
        device,
        instruction_overhead_s=fit.instruction_overhead_s,
        exec_s_per_byte=figures,
        hbm_bytes_per_s=bandwidth or device.hbm_bytes_per_s,
    )
    steps = tuple(
        predict(program, dataclasses.replace(fitted, dependency_latency_s=us * 1e-6),
                lookahead).step_s * 1e3
        for us in LATENCIES_US
    )  # fmt: skip
    return dataclasses.replace(
        fit, this_kernel_ms=steps, carried=tuple(n for n, c in figures if c)
    )


def load_report(path: Path) -> dict:
    """A GPU check's report, with the queue lengths of ``path``'s side file
    (``REPORT.queues.json``) for the cases that do not record their own."""
    report = json.loads(path.read_text())
    side = path.with_suffix(".queues.json")
    if side.exists():
        recorded = json.loads(side.read_text())["queue_lengths"]
        for name, case in report["cases"].items():
            timing = case.get("timing")
            if isinstance(timing, dict) and name in recorded:
                timing.setdefault("program", {}).setdefault(
                    "queue_lengths", recorded[name]
                )
    return report


def calibrate(report: dict, device: Device | None = None,
              carry: Collection[str] | None = None) -> list[Fit]:  # fmt: skip
    """Every timed case's ``Fit``, with ``predict_this_kernel``'s step
    (``carry``: the kinds whose execution figures it keeps; None: all)."""
    # The GPU check's bundle is planned for the H200's 132 SMs, whatever GPU
    # runs it (scripts/device_run.py, load_case).
    device = device or DEVICES["h200"]
    bandwidth = (report.get("bandwidth") or {}).get("read_bytes_per_s")
    fits = []
    for name, case in report["cases"].items():
        timing = case.get("timing")
        if isinstance(timing, dict):
            fit = fit_case(name, timing, device, bandwidth)
            if fit is None:
                continue
            try:
                fit = predict_this_kernel(fit, timing, device, bandwidth, carry)
            except ValueError as e:  # no kernel this checkout builds for it
                print(f"calibrate: {name}: this checkout's kernel: {e}",
                      file=sys.stderr)  # fmt: skip
            fits.append(fit)
    return fits


def markdown(fits: list[Fit], num_sms: int) -> str:
    def us(x):
        return "-" if x is None else f"{x * 1e6:.2f}"

    def ms(x):
        return "-" if x is None else f"{x:.3f}"

    lines = [
        "| case | measured ms | model ms | no waits ms | model no waits ms "
        "| us per instruction | dependency us | wait per phase us |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in fits:
        lines.append(
            f"| {f.case} | {f.measured_ms:.3f} | {f.predicted_ms:.3f} "
            f"| {ms(f.no_waits_ms)} | {ms(f.predicted_no_waits_ms)} "
            f"| {us(f.instruction_overhead_s)} | {us(f.dependency_latency_s)} "
            f"| {us(f.wait_per_phase_s)} |"
        )
    # What the fit predicts for the kernel this checkout builds.
    ours = [f for f in fits if f.this_kernel_ms is not None]
    if ours:
        at = " / ".join(map(str, LATENCIES_US))
        lines += ["", f"| case | this checkout's kernel ms, {at} us "
                  "| execution figures kept |", "| --- | --- | --- |"]  # fmt: skip
        for f in ours:
            steps = " / ".join(f"{x:.3f}" for x in f.this_kernel_ms)
            lines.append(f"| {f.case} | {steps} | {', '.join(f.carried) or '-'} |")
    # Per kind, TB/s all SMs execute its bytes at beyond the stream ("-":
    # the stream or the walk alone explains its row).
    rates = [f.exec_bytes_per_s(num_sms) for f in fits]
    kinds = [op.name for op in Op if any(r.get(op.name) for r in rates)]
    if kinds:
        lines += ["", "| case | " + " | ".join(kinds) + " |",
                  "| --- |" + " --- |" * len(kinds)]  # fmt: skip
        for f, r in zip(fits, rates, strict=True):
            cells = ["-" if r.get(k) is None else f"{r[k] / 1e12:.2f}" for k in kinds]
            lines.append(f"| {f.case} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("report", type=Path, help="device_check.json")
    parser.add_argument("--device", choices=sorted(DEVICES), default="h200")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--carry", metavar="KINDS", default=None,
        help="comma-separated opcode names whose execution figures the "
        "prediction for this checkout's kernel keeps (default: every fitted "
        "kind; '' for none): those whose code is unchanged since the "
        "report's commit",
    )  # fmt: skip
    args = parser.parse_args(argv)
    carry = None
    if args.carry is not None:
        carry = {k.strip() for k in args.carry.split(",") if k.strip()}
        unknown = carry - {op.name for op in Op}
        if unknown:
            parser.error(f"--carry: no opcode {', '.join(sorted(unknown))}")
    try:
        report = load_report(args.report)
    except (OSError, ValueError, KeyError) as e:
        print(f"calibrate: cannot read {args.report}: {e}", file=sys.stderr)
        return 2
    device = DEVICES[args.device]
    fits = calibrate(report, device, carry)
    if args.json:
        print(json.dumps([dataclasses.asdict(f) for f in fits]))
    else:
        print(markdown(fits, device.num_sms), end="")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
