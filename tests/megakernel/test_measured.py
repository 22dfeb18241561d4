# SPDX-License-Identifier: Apache-2.0
"""Never slower by default: the compiled kernel takes only the decode batches
a GPU check report measured it faster on than vLLM's own decode."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_ext.megakernel import build, measured
from vllm_ext.megakernel.plan import load_spec

ROOT = Path(__file__).resolve().parents[2]
GPU = "NVIDIA H200"
SOURCES = "0123456789abcdef"


def _case(batch: int, kernel_ms: float, baseline_ms: float, **timing) -> dict:
    return {
        "correctness": {"ok": True},
        "timing": {
            "batch": batch,
            "megakernel_ms": kernel_ms,
            "per_op_graph_ms": baseline_ms,
            "per_op_baseline": measured.FAIR_BASELINE,
            **timing,
        },
    }


def _report() -> dict:
    cases = {
        "llama-3.2-1b-b1": _case(1, 0.70, 0.80),
        "llama-3.2-1b-b2": _case(2, 0.75, 0.85),
        "llama-3.2-1b-b4": _case(4, 0.95, 0.90),  # slower: closes 4 and up
        "llama-3.2-1b-b8": _case(8, 0.90, 1.00),  # faster, but past a gap
        # A variant is another kernel; a wrong kernel opens nothing; nor do
        # figures timed against a weaker baseline.
        "llama-3.2-1b-b16-legacy": _case(16, 0.1, 9.0),
        "llama-3.1-8b-b1": {**_case(1, 0.1, 9.0), "correctness": {"ok": False}},
        "llama-3.1-8b-b4": _case(4, 0.1, 9.0, per_op_baseline="eager-ops"),
    }
    builds = {name: {"source_hash": SOURCES} for name in cases}
    return {"gpu": GPU, "cases": cases, "manifest": {"builds": builds},
            "verdict": "passed"}  # fmt: skip


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
    assert "batch 4: 0.950 vs 0.900 ms" in why and "report.json" in why


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


def test_a_failed_check_vouches_for_nothing(tmp_path):
    """A check that passed a planted bug or found sanitizer errors: none of
    its figures count, however fast."""
    report = {**_report(), "verdict": "failed"}
    path = tmp_path / "failed.json"
    path.write_text(json.dumps(report))
    assert measured.record(path, tmp_path / "table.json") == []


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
    monkeypatch.setattr(backend, "model_spec", lambda config: _spec("llama-3.2-1b"))
    monkeypatch.setattr(backend.MegakernelDecodeBackend, "_make_executor",
                        lambda self, model: "executor")  # fmt: skip
    attn = SimpleNamespace(sliding_window=None, layer_name="layers.0.attn")
    layer = SimpleNamespace(self_attn=SimpleNamespace(attn=attn))
    model = SimpleNamespace(model=SimpleNamespace(layers=[layer]))
    config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=512),
                             cache_config=SimpleNamespace(block_size=16))  # fmt: skip
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
