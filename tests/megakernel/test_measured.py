# SPDX-License-Identifier: Apache-2.0
"""Never slower by default: the compiled kernel takes only the decode batches
a passed GPU check measured it faster on than vLLM's own decode, by a margin
over the run's noise, for the sources that decide what it runs."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_ext.megakernel import build, measured
from vllm_ext.megakernel.plan import load_spec

ROOT = Path(__file__).resolve().parents[2]
GPU = "NVIDIA H200"
SOURCES = "0123456789abcdef"


def _runs(median: float, spread: float = 0.01) -> list[float]:
    """Five timings around ``median`` whose spread() is ``spread``."""
    half = median * spread / 2
    return [median - half, median, median, median, median + half]


def _case(batch: int, kernel_ms: float, baseline_ms: float, **timing) -> dict:
    return {
        "correctness": {"ok": True},
        "timing": {
            "batch": batch,
            "megakernel_ms": kernel_ms,
            "megakernel_runs_ms": _runs(kernel_ms),
            "per_op_graph_ms": baseline_ms,
            "per_op_graph_runs_ms": _runs(baseline_ms),
            "per_op_baseline": measured.FAIR_BASELINE,
            **timing,
        },
    }


PASSED_PARTS = {
    "abort": {"ok": True},
    "planted": {"llama-3.2-1b-b1-kv": {"rejected": True}},
    "sanitizer": {"memcheck": {"status": "passed"},
                  "racecheck": {"status": "passed"}},
}  # fmt: skip


def _report() -> dict:
    cases = {
        "llama-3.2-1b-b1": _case(1, 0.70, 0.80),
        "llama-3.2-1b-b2": _case(2, 0.75, 0.85),
        "llama-3.2-1b-b4": _case(4, 0.95, 0.90),  # slower: closes 4 and up
        "llama-3.2-1b-b8": _case(8, 0.90, 1.00),  # faster, but past a gap
        # A variant is another kernel; figures timed against a weaker
        # baseline open nothing.
        "llama-3.2-1b-b16-legacy": _case(16, 0.1, 9.0),
        "llama-3.1-8b-b4": _case(4, 0.1, 9.0, per_op_baseline="eager-ops"),
    }
    builds = {name: {"source_hash": SOURCES} for name in cases}
    return {"gpu": GPU, "cases": cases, "manifest": {"builds": builds},
            "verdict": "passed", **PASSED_PARTS}  # fmt: skip


def _write(tmp_path: Path, report: dict, name: str = "report.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(report))
    return path


@pytest.fixture
def table(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "measured_buckets.json"
    report = tmp_path / "report.json"
    report.write_text(json.dumps(_report()))
    measured.record(report, path)
    monkeypatch.setattr(measured, "TABLE", path)
    return path


def _spec(name: str):
    return load_spec(name, torch.bfloat16)


def test_only_faster_buckets_open_and_only_as_a_prefix(table):
    key = measured.model_key(_spec("llama-3.2-1b"))
    entries = sorted((e.model == key, e.batch) for e in measured.load(table))
    assert entries == [(True, 1), (True, 2), (True, 4), (True, 8)]
    taken, why = measured.max_batch(GPU, _spec("llama-3.2-1b"), SOURCES, table)
    assert taken == 2
    assert "batch 4: 0.950 vs 0.900 ms (margin 5%)" in why and "report.json" in why


def test_a_quantized_model_has_a_key_of_its_format(table):
    """Every config's model keys, a quantized checkpoint's by its format and
    the kinds of projections it leaves bf16 (Kimi-K2-Thinking's: a set),
    none the same; none of them opens a bucket measured for another."""
    names = ("kimi-k2", "kimi-k2-fp8", "kimi-k2-thinking", "llama-3.1-8b",
             "llama-3.1-8b-fp8", "llama-3.1-8b-w4a16")  # fmt: skip
    keys = {measured.model_key(_spec(n)) for n in names}
    assert len(keys) == len(names)
    thinking = _spec("kimi-k2-thinking")
    assert thinking.quant.experts_only
    assert measured.model_key(thinking) == measured.model_key(_spec("kimi-k2-thinking"))
    assert measured.max_batch(GPU, thinking, SOURCES, table)[0] == 0


@pytest.mark.parametrize(
    "gpu, name, sources",
    [
        ("NVIDIA H100 80GB HBM3", "llama-3.2-1b", SOURCES),  # another GPU
        (GPU, "llama-3.1-8b", SOURCES),  # another model (its cases opened none)
        (GPU, "llama-3.2-1b", "fedcba9876543210"),  # the kernel changed since
    ],
)
def test_anything_unmeasured_stays_on_vllms_path(table, gpu, name, sources):
    taken, why = measured.max_batch(gpu, _spec(name), sources, table)
    assert taken == 0
    assert why.startswith("no GPU check report measured this kernel")


def test_a_newer_report_replaces_the_older_figures(tmp_path, table):
    report = _report()
    report["cases"]["llama-3.2-1b-b4"] = _case(4, 0.85, 0.90)
    path = tmp_path / "newer.json"
    path.write_text(json.dumps(report))
    measured.record(path, table)
    assert measured.max_batch(GPU, _spec("llama-3.2-1b"), SOURCES, table)[0] == 8


@pytest.mark.parametrize(
    "part, value",
    [
        # Failed: a wrong case, a planted bug passed, a sanitizer's errors,
        # a hang not ended by the abort.
        ("cases", {"llama-3.1-8b-b1": {**_case(1, 0.1, 9.0),
                                       "correctness": {"ok": False}}}),
        ("planted", {"llama-3.2-1b-b1-kv": {"rejected": False}}),
        ("sanitizer", {"memcheck": {"status": "failed"},
                       "racecheck": {"status": "passed"}}),
        ("abort", {"ok": False}),
        # Incomplete: a required part did not run.
        ("planted", {"llama-3.2-1b-b1-kv": {"rejected": None}}),
        ("planted", {}),
        ("sanitizer", {"memcheck": {"status": "not run", "why": "out of time"},
                       "racecheck": {"status": "passed"}}),
        ("sanitizer", {}),
        ("abort", {}),
    ],
)  # fmt: skip
def test_only_a_passed_check_vouches(tmp_path, part, value):
    """However fast, and whatever verdict the report says: the verdict is
    re-derived from its parts, and only "passed" counts."""
    report = _report()
    report[part] = {**report[part], **value} if part == "cases" else value
    for said in ("passed", "incomplete"):
        path = _write(tmp_path, {**report, "verdict": said})
        assert measured.record(path, tmp_path / "table.json") == []
    assert measured.record(_write(tmp_path, _report()), tmp_path / "t.json")


@pytest.mark.parametrize(
    "kernel, baseline, opens",
    [
        (_runs(0.70), _runs(0.80), True),  # 12% faster, 1% noise each
        (_runs(0.78), _runs(0.80), False),  # 2.5%: under the 3% floor
        (_runs(0.70, 0.10), _runs(0.80, 0.06), False),  # inside 19% margin
        (_runs(0.60, 0.10), _runs(0.80, 0.06), True),  # 25% beats it
        # Medians, not means: one slow outlier does not hide a win (but
        # widens the margin by its spread).
        ([0.70, 0.70, 0.70, 0.70, 0.71], _runs(0.80), True),
        (_runs(0.70)[:2], _runs(0.80)[:2], False),  # too few timings
    ],
)
def test_faster_means_by_a_margin_over_the_noise(tmp_path, kernel, baseline, opens):
    report = _report()
    timing = report["cases"]["llama-3.2-1b-b1"]["timing"]
    timing.update(megakernel_runs_ms=kernel, per_op_graph_runs_ms=baseline)
    new = measured.record(_write(tmp_path, report), tmp_path / "table.json")
    b1 = [m for m in new if m.batch == 1 and m.model == measured.model_key(
        _spec("llama-3.2-1b"))]  # fmt: skip
    assert bool(b1 and b1[0].faster) == opens
    if b1:
        assert b1[0].margin == pytest.approx(
            measured.MIN_MARGIN + measured.spread(kernel) + measured.spread(baseline)
        )


def test_figures_without_repeated_timings_count_for_nothing(tmp_path):
    """Reports written before the timings were kept (docs/gpu-runs) carry
    one median per figure: no spread, so no margin, so no bucket."""
    report = _report()
    for case in report["cases"].values():
        del case["timing"]["megakernel_runs_ms"]
    assert measured.record(_write(tmp_path, report), tmp_path / "t.json") == []


def _call(cases: list[str], **parts) -> dict:
    """One device call's report: some of _report()'s cases, some parts."""
    full = _report()
    builds = {n: b for n, b in full["manifest"]["builds"].items() if n in cases}
    return {"gpu": GPU, "cases": {n: full["cases"][n] for n in cases},
            "manifest": {"builds": builds}, **parts}  # fmt: skip


def test_a_check_may_take_several_calls(tmp_path):
    """The first call ran the first cases, the abort and the planted bug but
    its deadline cut the sanitizers and the larger batches; a second call
    at the same sources ran those. Alone each is incomplete; together,
    passed, and the second call's figures count too."""
    first = _call(["llama-3.2-1b-b1", "llama-3.2-1b-b2"],
                  abort=PASSED_PARTS["abort"], planted=PASSED_PARTS["planted"],
                  sanitizer={"memcheck": {"status": "not run"},
                             "racecheck": {"status": "not run"}})  # fmt: skip
    second = _call(["llama-3.2-1b-b4", "llama-3.2-1b-b8"],
                   sanitizer=PASSED_PARTS["sanitizer"])  # fmt: skip
    # The first call's deadline skipped them: not run, not incorrect.
    skipped = {"correctness": {"ok": None, "why": "skipped: out of time"}}
    first["cases"].update({name: skipped for name in second["cases"]})
    for one in (first, second):
        assert measured.verdict(one)[0] == "incomplete"
    assert (
        "llama-3.2-1b-b4 not run (skipped: out of time)" in measured.verdict(first)[1]
    )
    merged = measured.combine([first, second])
    assert merged["verdict"] == "passed" and merged["combined_from"] == 2
    paths = [_write(tmp_path, first, "a.json"), _write(tmp_path, second, "b.json")]
    new = measured.record(paths, tmp_path / "table.json")
    assert sorted(m.batch for m in new) == [1, 2, 4, 8]
    assert {m.report for m in new} == {"a.json+b.json"}


def test_a_failure_in_one_call_is_never_outvoted(tmp_path):
    bad = _call(
        ["llama-3.2-1b-b1"],
        **{
            **PASSED_PARTS,
            "sanitizer": {
                "memcheck": {"status": "failed"},
                "racecheck": {"status": "passed"},
            },
        },
    )
    good = _call(["llama-3.2-1b-b1"], **PASSED_PARTS)
    wrong = _call(["llama-3.2-1b-b2"], **PASSED_PARTS)
    wrong["cases"]["llama-3.2-1b-b2"]["correctness"] = {"ok": False}
    right = _call(["llama-3.2-1b-b2"], **PASSED_PARTS)
    for calls in ([bad, good], [good, bad], [wrong, right]):
        assert measured.combine(calls)["verdict"] == "failed"


def test_calls_at_other_sources_do_not_combine():
    other = _call(["llama-3.2-1b-b2"], sanitizer=PASSED_PARTS["sanitizer"])
    other["manifest"]["builds"]["llama-3.2-1b-b2"]["source_hash"] = "f" * 16
    with pytest.raises(ValueError, match="different GPUs or kernels"):
        measured.combine([_call(["llama-3.2-1b-b1"], **PASSED_PARTS), other])
    with pytest.raises(ValueError, match="different GPUs or kernels"):
        other = {**_call(["llama-3.2-1b-b2"]), "gpu": "NVIDIA H100"}
        measured.combine([_call(["llama-3.2-1b-b1"]), other])


@pytest.mark.parametrize(
    "path, decides",
    [
        ("megakernel/planner.py", True),
        ("megakernel/cost.py", True),  # what the planner plans by
        ("megakernel/isa.py", True),
        ("megakernel/variants.py", True),
        ("megakernel/plan.py", True),
        ("megakernel/build.py", True),  # head parts, block size
        ("megakernel/kernel/shape.py", True),
        ("megakernel/kernel/aot.py", True),  # build flags
        ("megakernel/kernel/ops/attn.py", True),
        ("megakernel/kernel/glue.c", True),
        ("model_spec.py", True),
        # What checks or reports on the kernel, not what it runs.
        ("megakernel/measured.py", False),
        ("megakernel/calibrate.py", False),
        ("megakernel/interpret.py", False),
        ("megakernel/ops/attn.py", False),  # the interpreter's reference
    ],
)
def test_the_source_hash_covers_what_decides_the_kernel(tmp_path, path, decides):
    root = tmp_path / "vllm_ext"
    shutil.copytree(build.PACKAGE_DIR, root,
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    before = build.source_hash(root)
    assert before == build.source_hash()
    with open(root / path, "a") as f:
        f.write("\n// changed\n" if path.endswith(".c") else "\n# changed\n")
    assert (build.source_hash(root) != before) == decides


def test_the_recorded_gpu_runs_open_nothing(tmp_path):
    """Their per-op baselines were weaker than vLLM's decode."""
    runs = sorted((ROOT / "docs" / "gpu-runs").glob("*.json"))
    reports = [r for r in runs if not r.name.endswith(".queues.json")]
    assert reports
    for report in reports:
        assert measured.record(report, tmp_path / "table.json") == []


def _backend_log(monkeypatch, env: dict) -> tuple[object, list[str]]:
    """The backend as vLLM makes it on a GPU (device name and executor
    replaced), and what it logs at start-up."""
    from vllm_ext import backend

    for key in ("VLLM_MEGAKERNEL_INTERPRET", "VLLM_MEGAKERNEL_MAX_BATCH"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: GPU)
    monkeypatch.setattr(build, "source_hash", lambda: SOURCES)
    spec = _spec("llama-3.2-1b")
    monkeypatch.setattr(backend, "model_spec", lambda config, pp_rank: spec)
    monkeypatch.setattr(backend.MegakernelDecodeBackend, "_make_executor",
                        lambda self, model: "executor")  # fmt: skip
    attn = SimpleNamespace(sliding_window=None, layer_name="layers.0.attn")
    layer = SimpleNamespace(self_attn=SimpleNamespace(attn=attn))
    model = SimpleNamespace(model=SimpleNamespace(layers=[layer]))
    config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=512),
                             cache_config=SimpleNamespace(block_size=16),
                             parallel_config=SimpleNamespace(
                                 pipeline_parallel_size=1),
                             speculative_config=None)  # fmt: skip
    made = backend.MegakernelDecodeBackend(config, model, torch.device("cpu"))
    # What vLLM logs once, as "Decode backend 'megakernel' takes ...".
    return made, [made.describe()]


def test_the_backend_takes_what_was_measured_and_says_why(table, monkeypatch):
    made, log = _backend_log(monkeypatch, {})
    assert made.buckets == (1, 2)
    assert [made.accepts(n, n, 1) for n in (1, 2, 3)] == [True, True, False]
    assert log[0].startswith("decode batches of up to 2 requests (measured (")


def test_with_nothing_measured_it_takes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(measured, "TABLE", tmp_path / "empty.json")
    made, log = _backend_log(monkeypatch, {})
    assert made.buckets == () and made.executor is None
    assert not made.accepts(1, 1, 1)
    assert log[0].startswith("no decode batch: no GPU check report measured")


def test_the_users_max_batch_overrides_the_table(table, monkeypatch):
    made, log = _backend_log(monkeypatch, {"VLLM_MEGAKERNEL_MAX_BATCH": "4"})
    assert made.buckets == (1, 2, 4)
    assert "(VLLM_MEGAKERNEL_MAX_BATCH)" in log[0]
