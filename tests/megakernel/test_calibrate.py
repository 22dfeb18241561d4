# SPDX-License-Identifier: Apache-2.0
"""The cost model's figures from a GPU check's report: on the recorded H200
report, and recovered from a report the model itself wrote."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from vllm_ext.megakernel.calibrate import (
    LATENCIES_US,
    calibrate,
    fit_case,
    kernel_lookahead_bytes,
    load_report,
    main,
    phases,
    predict_this_kernel,
    probe,
)
from vllm_ext.megakernel.cost import DEVICES, predict
from vllm_ext.megakernel.isa import Op
from vllm_ext.megakernel.plan import load_spec
from vllm_ext.megakernel.planner import plan

RUNS = Path(__file__).resolve().parents[2] / "docs" / "gpu-runs"
REPORT = RUNS / "2026-11-30-h200-42d7577.json"


@pytest.fixture(scope="module")
def recorded() -> dict:
    """The recorded report's fits (about 40 s here: every row is solved
    for)."""
    return {f.case: f for f in calibrate(load_report(REPORT))}


GEMVS = ("QKV", "O_PROJ", "GATE_UP", "DOWN", "LM_HEAD")


def test_recorded_h200_report(recorded):
    """The first H200 check (no waits probe yet): 0.9 us per instruction
    walked, 7-11 us per phase boundary at batch 1 (docs/perf.md). Its
    CUDA-core GEMVs execute their bytes slower with every batch (issue-bound:
    at batch 16 under 1.5 TB/s, below batch 1's on each matrix). Fitted on
    each kind's row alone, the model puts the rows back together into the
    step without waits within 10%; at batch 1, with 1 us per dependency, it
    stays under the measured step (the boundaries cost more)."""
    fits = recorded
    assert set(fits) == {f"llama-3.{m}-b{b}" for m in ("2-1b", "1-8b")
                         for b in (1, 4, 16)}  # fmt: skip
    for f in fits.values():
        assert 0.8e-6 < f.instruction_overhead_s < 0.95e-6
        # The model's figure for the H200 is this report's, within 10%.
        assert f.instruction_overhead_s == pytest.approx(
            DEVICES["h200"].instruction_overhead_s, rel=0.1
        )
        assert f.dependency_latency_s is None
        assert f.predicted_no_waits_ms == pytest.approx(f.no_waits_ms, rel=0.1)
        # The all-NOP walk explains the embedding's and final norm's rows.
        assert dict(f.exec_s_per_byte)["EMBED"] == 0
    for model in ("llama-3.2-1b", "llama-3.1-8b"):
        one, many = fits[f"{model}-b1"], fits[f"{model}-b16"]
        assert 5e-6 < one.wait_per_phase_s < 12e-6
        assert one.predicted_ms < one.measured_ms
        rate_1, rate_16 = one.exec_bytes_per_s(132), many.exec_bytes_per_s(132)
        for kind in GEMVS:
            assert rate_16[kind] < min(1.5e12, rate_1[kind])


@pytest.mark.parametrize("overhead, latency", [(0.7e-6, 2.5e-6), (0.9e-6, 0.8e-6)])
def test_recovers_the_figures_a_model_report_was_made_with(overhead, latency):
    spec = load_spec("llama-3.2-1b", torch.bfloat16)
    device = DEVICES["h200"]
    program = plan(spec, 1, device, with_lm_head=True)
    truth = dataclasses.replace(device, instruction_overhead_s=overhead,
                                dependency_latency_s=latency)  # fmt: skip
    walk = predict(probe(program, keep=(), waits=False), truth).step_s * 1e3
    chain = predict(probe(program, keep=()), truth).step_s * 1e3
    whole = predict(program, truth).step_s * 1e3
    timing = {
        "megakernel_ms": whole,
        "breakdown": {
            "NOP": {"ms": walk},
            "NOP, waits": {"ms": chain},
            "no waits": {"ms": walk},
        },
    }
    fit = fit_case("llama-3.2-1b-b1", timing, device, None, program=program)
    assert fit.instruction_overhead_s == pytest.approx(overhead, rel=1e-3)
    assert fit.dependency_latency_s == pytest.approx(latency, rel=1e-3)
    assert fit.predicted_ms == pytest.approx(whole, rel=1e-3)
    assert fit.wait_per_phase_s == pytest.approx(
        (whole - walk) * 1e-3 / phases(program)
    )


@pytest.mark.parametrize(
    "config, batch, terms, idle, context",
    [("llama-3.2-1b", 1, {"ATTN": 5e-10, "GATE_UP": 2e-10}, "DOWN", None),
     ("llama-3.2-1b", 16, {"ATTN": 5e-10, "GATE_UP": 3.2e-9}, "DOWN", None),
     # TOPK's routing also runs inside each SM's first routed EXPERT_UP
     # tile: fitted first, it is not counted into EXPERT_UP's figure.
     ("qwen3-30b-a3b", 1, {"TOPK": 1e-8, "EXPERT_UP": 1e-10}, "ROUTE", None),
     # A run at 512 tokens of history (the GPU check's): ATTN's figure is
     # per byte of that history, not of the model's nominal 1024.
     ("llama-3.2-1b", 16, {"ATTN": 5e-10, "GATE_UP": 3.2e-9}, "DOWN", 512)],
)  # fmt: skip
def test_recovers_the_execution_figures_a_model_report_was_made_with(
    config, batch, terms, idle, context
):
    """Rows made by the model with a per-byte figure for two kinds give those
    figures back within 1%; a kind that keeps up with its stream gets 0;
    the whole step is the model's."""
    spec = load_spec(config, torch.bfloat16).with_layers(2)
    device = DEVICES["h200"]
    program = plan(spec, batch, device, with_lm_head=True)
    ran = program if context is None else dataclasses.replace(program, context=context)
    truth = dataclasses.replace(device, exec_s_per_byte=tuple(terms.items()))
    walk = probe(ran, keep=(), waits=False)
    rows = {"NOP": {"ms": predict(walk, truth).step_s * 1e3}}
    for kind in (*terms, idle):
        row = probe(ran, keep=(Op[kind],), waits=False)
        rows[kind] = {"ms": predict(row, truth).step_s * 1e3}
    timing = {"megakernel_ms": predict(ran, truth).step_s * 1e3,
              "breakdown": rows}  # fmt: skip
    if context is not None:
        timing["context"] = context
    fit = fit_case(f"{config}-b{batch}", timing, device, None, program=program)
    got = dict(fit.exec_s_per_byte)
    assert set(got) == {*terms, idle}
    for kind, figure in terms.items():
        assert got[kind] == pytest.approx(figure, rel=0.01), kind
    assert got[idle] == 0
    assert fit.predicted_ms == pytest.approx(timing["megakernel_ms"], rel=0.01)


def test_the_model_runs_each_case_with_its_kernels_lookahead():
    """A report that records the kernel's shape is modelled with that
    kernel's lookahead: the default kernel's ring plus the L2 cursor's 6
    pages; the legacy control's next-instruction prefetch (also what a
    record from before the warp roles ran). More lookahead, a shorter
    modelled step."""
    from vllm_ext.megakernel.kernel.ops.weight_pipe import L2_AHEAD_PAGES
    from vllm_ext.megakernel.kernel.persistent import ring_slots
    from vllm_ext.megakernel.kernel.shape import PAGE_BYTES, KernelShape

    spec = load_spec("llama-3.2-1b", torch.bfloat16)
    device = DEVICES["h200"]
    program = plan(spec, 1, device, with_lm_head=True)
    shape = KernelShape.from_program(program, 16)
    kernels = {
        "legacy": dataclasses.replace(shape, legacy_control=True),
        "default": shape,
    }  # fmt: skip
    ring = ring_slots(kernels["default"]) * PAGE_BYTES
    look = {k: kernel_lookahead_bytes(v.as_dict()) for k, v in kernels.items()}
    assert look["default"] == ring + L2_AHEAD_PAGES * PAGE_BYTES
    assert look["legacy"] < look["default"]
    assert kernel_lookahead_bytes(None) is None
    # Records from before the warp roles: their default was the legacy
    # control; their staging variants' kernels no longer exist.
    old = {k: v for k, v in shape.as_dict().items() if k != "legacy_control"}
    assert kernel_lookahead_bytes({**old, "weight_pipe": False}) == look["legacy"]
    assert kernel_lookahead_bytes({**old, "weight_pipe": True}) is None
    rows = {"NOP": {"ms": 0.074}, "no waits": {"ms": 0.8}}
    ms = {}
    for name, kernel in (*kernels.items(), ("unrecorded", None)):
        timing = {"megakernel_ms": 1.0, "breakdown": rows,
                  "shape": kernel.as_dict() if kernel else None}  # fmt: skip
        ms[name] = fit_case("llama-3.2-1b-b1", timing, device, None,
                            program=program).predicted_ms  # fmt: skip
    assert ms["legacy"] > ms["default"]
    # Without a recorded kernel: the device's lookahead (the design's).
    assert ms["unrecorded"] == pytest.approx(predict(program, dataclasses.replace(
        device, instruction_overhead_s=0.074e-3 / max(map(len, program.queues)))
    ).step_s * 1e3)  # fmt: skip


def test_the_fit_predicts_this_checkouts_kernel():
    """A report the model made for the legacy control on whole heads (as the
    2026-11-30 H200 run ran, at 512 tokens and its own bandwidth), with
    execution figures for ATTN and GATE_UP: ``predict_this_kernel`` gives
    the model's step for the default program and kernel (head parts; the
    ring's lookahead, not the report's) at that context and bandwidth with
    the figures of the kinds carried (all, ATTN's only, none), at 1 / 2 / 5
    us. Each figure carried costs time. A variant case is left alone: its
    figures are another kernel's."""
    from vllm_ext.megakernel.kernel.shape import KernelShape

    spec = load_spec("llama-3.2-1b", torch.bfloat16).with_layers(2)
    device = DEVICES["h200"]
    ran = plan(spec, 1, device, with_lm_head=True, qkv_parts=1, combine_parts=1)
    legacy = dataclasses.replace(KernelShape.from_program(ran, 16), legacy_control=True)
    look_ran = kernel_lookahead_bytes(legacy.as_dict())
    context, bandwidth = 512, 3.9e12
    ran = dataclasses.replace(ran, context=context)
    terms = {"ATTN": 2e-9, "GATE_UP": 2e-10}
    truth = dataclasses.replace(device, exec_s_per_byte=tuple(terms.items()),
                                hbm_bytes_per_s=bandwidth)  # fmt: skip
    rows = {"NOP": {"ms": predict(probe(ran, keep=(), waits=False), truth,
                                  look_ran).step_s * 1e3}}  # fmt: skip
    for kind in terms:
        row = probe(ran, keep=(Op[kind],), waits=False)
        rows[kind] = {"ms": predict(row, truth, look_ran).step_s * 1e3}
    timing = {"megakernel_ms": predict(ran, truth, look_ran).step_s * 1e3,
              "breakdown": rows, "shape": legacy.as_dict(), "layers": 2,
              "context": context}  # fmt: skip
    fit = fit_case("llama-3.2-1b-b1", timing, device, bandwidth, program=ran)
    assert dict(fit.exec_s_per_byte) == pytest.approx(terms, rel=0.01)

    ours = dataclasses.replace(
        plan(spec, 1, device, with_lm_head=True), context=context
    )
    assert ours.qkv_parts > 1
    look = kernel_lookahead_bytes(KernelShape.from_program(ours, 16).as_dict())
    assert look > look_ran
    steps = {}
    for carry, kept in ((None, terms), ({"ATTN"}, {"ATTN": terms["ATTN"]}),
                        (set(), {})):  # fmt: skip
        got = predict_this_kernel(fit, timing, device, bandwidth, carry)
        assert got.carried == tuple(kept)
        want = [predict(ours, dataclasses.replace(
                    truth, exec_s_per_byte=tuple(kept.items()),
                    instruction_overhead_s=fit.instruction_overhead_s,
                    dependency_latency_s=us * 1e-6), look).step_s * 1e3
                for us in LATENCIES_US]  # fmt: skip
        assert got.this_kernel_ms == pytest.approx(want, rel=0.01)
        steps[len(kept)] = got.this_kernel_ms
    assert steps[2][0] > steps[1][0] > steps[0][0]
    wide = dataclasses.replace(fit, case="llama-3.2-1b-b1-wide")
    assert predict_this_kernel(wide, timing, device, bandwidth) == wide


def one_case_report(tmp_path: Path, case: str) -> Path:
    """One case of the recorded report, with its side file."""
    report = json.loads(REPORT.read_text())
    report["cases"] = {case: report["cases"][case]}
    (tmp_path / "one.json").write_text(json.dumps(report))
    side = REPORT.with_suffix(".queues.json")
    (tmp_path / "one.queues.json").write_text(side.read_text())
    return tmp_path / "one.json"


def test_cli(capsys, tmp_path):
    case = "llama-3.2-1b-b1"
    one_case_report(tmp_path, case)
    assert main([str(tmp_path / "one.json")]) == 0
    out = capsys.readouterr().out
    assert f"| {case} | 1.457 |" in out
    assert "| case | QKV | ATTN |" in out  # each kind's execution rate
    # The model's steps for this checkout's kernel (docs/predictions.md,
    # "This checkout's kernel at the report's rates": update both when the
    # planner or the model changes them).
    assert "| case | this checkout's kernel ms, 1 / 2 / 5 us |" in out
    assert f"| {case} | 0.935 / 1.015 / 1.269 | QKV, ATTN, O_PROJ," in out
    assert main([str(tmp_path / "one.json"), "--carry", "ATTN"]) == 0
    assert f"| {case} | 0.610 / 0.647 / 0.826 | ATTN |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([str(tmp_path / "one.json"), "--carry", "ATTENTION"])
    assert main([str(tmp_path / "missing.json")]) == 2


def test_a_case_with_no_kernel_here_keeps_its_fit(capsys, tmp_path, monkeypatch):
    """Where this checkout builds no kernel for a case, its fit stays and
    the reason is named; the other tables do not depend on it."""
    from vllm_ext.megakernel.kernel.shape import KernelShape

    def refuse(*args, **kwargs):
        raise ValueError("head_dim 96: 64 or 128")

    monkeypatch.setattr(KernelShape, "from_program", refuse)
    case = "llama-3.2-1b-b1"
    (fit,) = calibrate(load_report(one_case_report(tmp_path, case)))
    assert fit.case == case and fit.this_kernel_ms is None
    assert f"calibrate: {case}: this checkout's kernel: head_dim 96" in (
        capsys.readouterr().err
    )


def test_the_overhead_is_over_the_queues_that_ran(recorded):
    """The all-NOP time over the longest queue of the program the report
    ran (its side file's lengths), not of the program planned here; a
    report without them is refused, not fitted on the wrong program."""
    report = json.loads(REPORT.read_text())
    case = "llama-3.2-1b-b1"
    nop_s = report["cases"][case]["timing"]["breakdown"]["NOP"]["ms"] * 1e-3
    side = json.loads(REPORT.with_suffix(".queues.json").read_text())
    longest = max(side["queue_lengths"][case])
    fit = recorded[case]
    assert fit.instruction_overhead_s == pytest.approx(nop_s / longest)
    with pytest.raises(ValueError, match="no queue lengths"):
        calibrate(report)
    # The waits probe is solved on the program planned here: only when that
    # is the one that ran (42d7577 planned a longer queue than the caps do).
    report = load_report(REPORT)
    timing = report["cases"][case]["timing"]
    timing["breakdown"]["NOP, waits"] = {"ms": 0.5}
    with pytest.raises(ValueError, match="not the one that ran"):
        calibrate({"cases": {case: report["cases"][case]}})


def test_a_case_of_fewer_layers_is_replanned_at_its_depth():
    """A case the bundle ran with its first layers only (the mixtures' and
    latent attention's cases) is re-planned at that depth: its recorded
    queues are then the program's, and the waits probe is solved."""
    device = DEVICES["h200"]
    spec = load_spec("llama-3.2-1b", torch.bfloat16).with_layers(2)
    program = plan(spec, 1, device, with_lm_head=True)
    walk = predict(probe(program, keep=(), waits=False), device).step_s * 1e3
    chain = predict(probe(program, keep=()), device).step_s * 1e3
    timing = {
        "megakernel_ms": 2 * chain,
        "layers": 2,
        "program": {
            "qkv_parts": program.qkv_parts,
            "combine_parts": program.combine_parts,
            "queue_lengths": [len(q) for q in program.queues],
        },
        "breakdown": {"NOP": {"ms": walk}, "NOP, waits": {"ms": chain}},
    }
    fit = fit_case("llama-3.2-1b-b1", timing, device, None)
    assert fit.dependency_latency_s == pytest.approx(
        device.dependency_latency_s, rel=1e-3
    )


def test_a_reordered_program_of_the_same_lengths_is_refused():
    """The digest a report records tells the program that ran from one
    planned later with the same queue lengths but another order (the
    lengths alone do not)."""
    device = DEVICES["h200"]
    spec = load_spec("llama-3.2-1b", torch.bfloat16).with_layers(2)
    program = plan(spec, 1, device, with_lm_head=True)
    walk = predict(probe(program, keep=(), waits=False), device).step_s * 1e3
    timing = {
        "megakernel_ms": 2 * walk,
        "layers": 2,
        "program": {
            "digest": program.digest(),
            "qkv_parts": program.qkv_parts,
            "combine_parts": program.combine_parts,
            "queue_lengths": [len(q) for q in program.queues],
        },
        "breakdown": {"NOP": {"ms": walk}},
    }
    assert fit_case("llama-3.2-1b-b1", timing, device, None) is not None
    # Two SMs' queues swapped: the same multiset of lengths, another program.
    queues = list(program.queues)
    k = next(i for i in range(1, len(queues)) if queues[i] != queues[0])
    queues[0], queues[k] = queues[k], queues[0]
    swapped = dataclasses.replace(program, queues=tuple(queues))
    assert swapped.digest() != program.digest()
    timing["program"]["digest"] = swapped.digest()
    timing["program"]["queue_lengths"] = [len(q) for q in swapped.queues]
    with pytest.raises(ValueError, match="digest differs"):
        fit_case("llama-3.2-1b-b1", timing, device, None)


def test_a_case_of_a_program_no_longer_planned_is_skipped():
    """A report from before 2026-12-02 may hold fused-COMBINE cases (the
    GPU check's tail and fast): skipped, the other cases still fitted."""
    device = DEVICES["h200"]
    spec = load_spec("llama-3.2-1b", torch.bfloat16).with_layers(2)
    program = plan(spec, 1, device, with_lm_head=True)
    walk = predict(probe(program, keep=(), waits=False), device).step_s * 1e3

    def timing(**options) -> dict:
        record = {"qkv_parts": program.qkv_parts,
                  "combine_parts": program.combine_parts,
                  "queue_lengths": [len(q) for q in program.queues],
                  **options}  # fmt: skip
        return {"timing": {"megakernel_ms": 2 * walk, "layers": 2,
                           "program": record,
                           "breakdown": {"NOP": {"ms": walk}}}}  # fmt: skip

    report = {"cases": {"llama-3.2-1b-b1-tail": timing(fuse_combine=True),
                        "llama-3.2-1b-b1": timing()}}  # fmt: skip
    fits = calibrate(report)
    assert [f.case for f in fits] == ["llama-3.2-1b-b1"]
