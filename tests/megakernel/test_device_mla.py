# SPDX-License-Identifier: Apache-2.0
"""The GPU check's multi-head latent attention cases, where no GPU is needed:
device_run's correctness harness on an MLA case (a shrunk DeepSeek-V3: 4
heads, latent 512 + rope 64, a dense layer then a grouped-sigmoid mixture),
the compiled kernel replaced by the CPU stand-in (kernel_standin.py), passes
a correct kernel and names the instruction of each planted error (a latent
row appended to the wrong slot, a head group's partial in another's place,
a corrupted LSE, ...); the per-op MLA baseline computes the reference
forward; the roofline's byte and FLOP counts are the weights' and the
attention's."""

import ctypes
import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
import torch
from kernel_standin import KernelStandIn, register_executor
from test_mla_program import mla_spec

from tests.utils import load_script
from vllm_ext.megakernel.build import save_program
from vllm_ext.megakernel.cost import DEVICES
from vllm_ext.megakernel.kernel.launcher import KernelExecutor
from vllm_ext.megakernel.kernel.shape import KernelShape
from vllm_ext.megakernel.plan import spec_or_exit
from vllm_ext.megakernel.planner import plan
from vllm_ext.reference import ReferenceExecutor
from vllm_ext.testing import BLOCK_SIZE, random_decode_inputs, random_weights

MLA_CHECKS = {"MLA_QKV_A", "MLA_Q", "MLA_Q_PE", "MLA_APPEND", "MLA_ATTN",
              "MLA_ATTN_LSE", "MLA_COMBINE", "O_PROJ", "GATE_UP", "DOWN", "ROUTE",
              "TOPK", "EXPERT_UP", "EXPERT_DOWN", "KV_STRAY", "GUARD", "INPUTS",
              "WEIGHTS"}  # fmt: skip
ROOT = Path(__file__).resolve().parents[2]
# The corrupted layer: the last (sparse) one, whose every chunk is checked.
LAYER = 1


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def harness(tmp_path, monkeypatch):
    """device_run on CPU over an MLA case at batch 2 (132 SMs: 4 head groups
    x 16 chunks, 2 v parts), the kernel a stand-in; ``plant(ex, before)``,
    if set, corrupts what the "kernel" left after each launch (``before``:
    the caches as they were before it), or before it with ``early``."""
    d = load_script("scripts/device_run.py")
    monkeypatch.setattr(d, "DEVICE", "cpu")
    monkeypatch.setattr(d, "CONTEXT", 40)
    monkeypatch.setattr(d, "FULL_CHECK_BATCHES", (2,))
    spec = mla_spec(torch.bfloat16)
    assert spec.moe.sparse_layers == (False, True)
    program = plan(spec, 2, DEVICES["h200"], with_lm_head=True)
    assert (program.mla_head_groups, program.attn_chunks) == (4, 16)
    case = tmp_path / "mla-b2"
    case.mkdir()
    save_program(case / "program.pt", program,
                 KernelShape.from_program(program, BLOCK_SIZE))  # fmt: skip
    plant: dict = {}

    def make_executor(case_dir, program, weights, max_blocks):
        standin = KernelStandIn(program, weights)

        def launch(*args):
            register_executor(standin, ex, ex.kv_caches)
            before = [c.clone() for c in ex.kv_caches]
            if plant.get("early"):
                plant["early"](ex)
            standin(*args)
            if plant.get("late"):
                plant["late"](ex, before)

        ex = KernelExecutor(program, weights, launch, block_size=BLOCK_SIZE,
                            max_blocks=max_blocks)  # fmt: skip
        return ex, None

    monkeypatch.setattr(d, "make_executor", make_executor)
    return d, case, plant


def test_a_correct_mla_kernel_passes_every_check(harness):
    d, case, _ = harness
    result = d.correctness(case)
    assert result["ok"], result
    step = result["steps"][0]
    assert set(step["errors"]) >= MLA_CHECKS
    assert not {"QKV", "KV_APPEND", "ATTN", "COMBINE"} & set(step["errors"])
    # The attention unsplit against the torch reference (FlashInfer's MLA
    # decode is not carried: said so in the check).
    check = step["errors"]["mla_attn_vs_torch"]
    assert check["max"] <= check["tol"] and "torch" in check["reference"]
    # Drift from the interpreter over the MLA buffers, greedy agreement.
    assert {"qkv_a", "q_lat", "q_pe", "part_o"} <= set(step["drift"])
    assert "q" not in step["drift"]
    assert all(s["greedy_agree"] == f"{s['batch']}/{s['batch']}"
               for s in result["steps"])  # fmt: skip
    assert result["graph"]["ok"] and len(result["graph"]["replays"]) == d.GRAPH_REPLAYS


def _wrong_slot(ex, before):
    """The new latent row appended one slot over (slot ^ 1, as the dense
    planted bug "kv-slot"): the right slot keeps its old row."""
    cache, old = ex.kv_caches[LAYER], before[LAYER]
    bs = cache.shape[1]
    for s in ex.slot_mapping.tolist():
        if s >= 0:
            row = cache[s // bs, s % bs].clone()
            cache[s // bs, s % bs] = old[s // bs, s % bs]
            cache[(s ^ 1) // bs, (s ^ 1) % bs] = row


def _swapped_groups(ex, before):
    """Head groups 0 and 1 each wrote the other's partial o."""
    ex.ws["part_o"][LAYER][:, [0, 1]] = ex.ws["part_o"][LAYER][:, [1, 0]].clone()


def _lse(ex, before):
    """One head group's LSE of the first chunk (never empty) off by 0.5."""
    ex.ws["part_lse"][LAYER][0, 2] += 0.5


def _buffer(name):
    def corrupt(ex, before):
        ex.ws[name][LAYER] += 1.0

    return corrupt


@pytest.mark.parametrize(
    "late, failing, passing",
    [
        (_wrong_slot, {"MLA_APPEND", "KV_STRAY"}, {"MLA_QKV_A", "MLA_Q"}),
        (_swapped_groups, {"MLA_ATTN"}, {"MLA_ATTN_LSE", "MLA_Q", "MLA_APPEND"}),
        (_lse, {"MLA_ATTN_LSE"}, {"MLA_ATTN", "MLA_Q", "MLA_APPEND"}),
        (_buffer("qkv_a"), {"MLA_QKV_A"}, {"KV_STRAY"}),
        (_buffer("q_lat"), {"MLA_Q"}, {"MLA_QKV_A", "MLA_Q_PE", "MLA_APPEND"}),
        (_buffer("q_pe"), {"MLA_Q_PE"}, {"MLA_QKV_A", "MLA_Q"}),
        (_buffer("attn"), {"MLA_COMBINE", "mla_attn_vs_torch"},
         {"MLA_ATTN", "MLA_ATTN_LSE"}),
    ],
    ids=["wrong-slot", "swapped-groups", "lse", "qkv_a", "q_lat", "q_pe", "attn"],
)  # fmt: skip
def test_a_planted_mla_error_fails_its_instruction(harness, late, failing, passing):
    """Each error fails the instruction that made it, at its layer, and
    the instructions upstream of it still pass."""
    d, case, plant = harness
    plant["late"] = late
    result = d.correctness(case)
    assert not result["ok"]
    errors = result["steps"][0]["errors"]
    for op in failing:
        assert not d.passes(errors[op]), op
        assert errors[op].get("layer", LAYER) == LAYER
    for op in passing:
        assert d.passes(errors[op]), (op, errors[op])
    assert d.passes(errors["EMBED"])


def test_a_stray_write_to_a_latent_history_row_fails(harness):
    """Each request's first row changed before the attention reads it: the
    kernel and a reference on the kernel's cache would agree; the copy from
    before the step does not."""
    d, case, plant = harness

    def history(ex):
        cache = ex.kv_caches[LAYER]
        for r, slot in enumerate(ex.slot_mapping.tolist()):
            if slot >= 0 and int(ex.seq_lens[r]) > 1:
                cache[int(ex.block_table[r, 0]), 0] += 1.0

    plant["early"] = history
    errors = d.correctness(case)["steps"][0]["errors"]
    assert not d.passes(errors["KV_STRAY"]) and errors["KV_STRAY"]["layer"] == LAYER
    assert not d.passes(errors["MLA_ATTN"])
    assert d.passes(errors["MLA_APPEND"]) and d.passes(errors["MLA_Q"])


def test_a_case_runs_the_manifests_layers(harness):
    """device_check.sh's "layers" map (DEVICE_CHECK_MLA's LAYERS) cuts the
    program; the spec comes back with its latent attention."""
    d, case, _ = harness
    (case.parent / "manifest.json").write_text(json.dumps({"layers": {case.name: 1}}))
    spec, program = d.load_case(case)
    assert spec.num_layers == 1 and spec.mla.kv_lora_rank == 512
    assert program.spec.moe.sparse_layers == (False,)
    result = d.correctness(case)
    assert result["ok"] and "ROUTE" not in result["steps"][0]["errors"]


# ------------------------------------------------------------ baseline

# Logits against the reference forward's (max |a - b| / max |b|), as
# test_per_op_baseline.py's TOL: the GEMMs sum in another order.
TOL = 1e-2


def _clone(inputs):
    return dataclasses.replace(
        inputs, kv_caches=tuple(c.clone() for c in inputs.kv_caches)
    )


@pytest.mark.parametrize("q_lora_rank", [96, None], ids=["q_lora", "q_proj"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_per_op_mla_step_is_the_reference_step(q_lora_rank, compiled):
    m = load_script("scripts/baseline/mla_per_op.py")
    spec = mla_spec(torch.bfloat16, q_lora_rank)
    weights = random_weights(spec, seed=3)
    inputs = random_decode_inputs(spec, 3, seed=5)
    mine = _clone(inputs)
    out = ReferenceExecutor(spec, weights).step(inputs)
    ref = out.float() @ weights.lm_head.float().t()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    options = {"backend": "aot_eager"} if compiled else None
    step = m.mla_per_op_step(spec, weights, mine,
                             m.torch_mla_attend(spec, weights, mine),
                             compile_options=options)  # fmt: skip
    got = step()
    assert ((got - ref).abs().max() / ref.abs().max()).item() < TOL
    # The new latent rows are the reference's, in the reference's slots
    # (and nothing else changed: the caches started equal), to two bf16
    # steps: kv_c is a GEMM rounded to bf16, then RMS-normed, which carries
    # one step of a different summation order (the CPU's GEMM kernel) into
    # up to two (2 of 110592 elements on an AMD EPYC, 2026-12-02).
    for a, b in zip(mine.kv_caches, inputs.kv_caches, strict=True):
        torch.testing.assert_close(a, b, rtol=2**-6, atol=2**-7)
    if compiled:  # first, middle (dense 0 into 1), moe_in, final: no break
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 4
        assert not torch._dynamo.utils.counters["graph_break"]
    # A wrong attention scale is not the step (the comparison can fail).
    wrong = dataclasses.replace(weights, attn_scale=2 * weights.attn_scale)
    again = _clone(inputs)
    attend = m.torch_mla_attend(spec, wrong, again)
    bad = m.mla_per_op_step(spec, wrong, again, attend)
    assert ((bad() - ref).abs().max() / ref.abs().max()).item() > TOL


def test_the_attention_alone_runs_every_layer():
    m = load_script("scripts/baseline/mla_per_op.py")
    spec = mla_spec(torch.bfloat16)
    weights = random_weights(spec, seed=3)
    inputs = random_decode_inputs(spec, 2, seed=5)
    calls = []
    attend = m.torch_mla_attend(spec, weights, inputs)

    def counted(layer, *args):
        calls.append(layer)
        return attend(layer, *args)

    out = m.attention_only(spec, inputs, counted)()
    mla = spec.mla
    assert calls == [0, 1] and out.shape == (2, mla.num_heads * mla.v_head_dim)
    assert torch.isfinite(out.float()).all()


# ------------------------------------------------------------ roofline


def test_roofline_counts_the_weights_and_the_attention():
    dm = load_script("scripts/device_mla.py")
    spec = mla_spec(torch.bfloat16)
    lw = random_weights(spec, seed=0).layers[0]
    drawn = sum(t.nbytes for t in (lw.mla.q_a, lw.mla.q_b, lw.mla.kv_a, lw.mla.kv_b,
                                   lw.o_proj))  # fmt: skip
    assert dm.attention_weight_bytes(spec) == drawn
    # The real shapes at the 4k tokens, batch 1: 2 * heads * T *
    # (576 + 512) FLOPs and 4096 rows of 576 bf16.
    for model, heads, weights_mb in (("deepseek-v3", 128, 374), ("kimi-k2", 64, 202)):
        real = spec_or_exit("test", model, "bfloat16", 1)
        r = dm.roofline(real, 1, 4096)
        assert r["heads"] == heads and r["cache_bytes"] == 4096 * 576 * 2
        assert r["attention_flops"] == 2 * heads * 4096 * 1088
        assert round(r["attention_weight_bytes"] / 1e6) == weights_mb
    # 128 heads: the tensor-core term; 64: the rows' bytes (4.3 TB/s).
    deepseek = dm.roofline(spec_or_exit("test", "deepseek-v3", "bfloat16", 1), 1, 4096)
    kimi = dm.roofline(spec_or_exit("test", "kimi-k2", "bfloat16", 1), 1, 4096)
    assert dm.roofline_us(deepseek, 4.3e12) == pytest.approx(1.444, abs=1e-3)
    assert dm.roofline_us(kimi, 4.3e12) == pytest.approx(1.097, abs=1e-3)
    assert dm.roofline_us(kimi, 4.3e12, with_weights=True) == pytest.approx(
        (kimi["attention_weight_bytes"] + kimi["cache_bytes"]) / 4.3e6, rel=1e-9
    )


def test_report_has_the_mla_table():
    d = load_script("scripts/device_run.py")
    spec = spec_or_exit("test", "kimi-k2", "bfloat16", 1)
    report = {
        "gpu": "NVIDIA H200", "num_sms": 132, "torch": "2.11", "skipped": [],
        "manifest": {"commit": "abc"}, "bandwidth": {"read_bytes_per_s": 4e12},
        "trap": {"ok": True}, "planted": {}, "sanitizer": {},
        "cases": {"kimi-k2-b1": {"correctness": {"ok": True}, "timing": {
            "megakernel_ms": 0.5, "per_op_graph_ms": 0.75, "layers": 2,
            "per_op_attention_ms": 0.05, "weight_bytes": 10**9,
            "per_op_attention": "torch-absorbed-mla",
            "flashinfer_mla": {"mla_attn_vs_flashinfer": {"max": 0.002}},
            "roofline": d.device_mla.roofline(spec, 1, 4096),
            "breakdown": {"MLA_ATTN": {"ms": 0.01, "weight_bytes": 0},
                          "MLA_COMBINE": {"ms": 0.02, "weight_bytes": 10**7}}}}},
    }  # fmt: skip
    table = d.markdown(report)
    # 4.72 MB of rows at 4 TB/s: 1.2 us; with 202 MB of weights, 51.7 us.
    assert ("| kimi-k2-b1 | 64 | 4096 | 2 | 0.500 | 0.750 | 0.050 | 0.010 | 0.020 "
            "| 1.2 | 51.7 | torch-absorbed-mla | 2.0e-03 |") in table  # fmt: skip
    assert "per-op attention: torch-absorbed-mla" in table


def _timing_case(harness, monkeypatch, breakdown):
    """A stepped MLA case for ``mla_timing`` on CPU: timers and graphs stood
    in for, the reference's mixture in place of vLLM's fused MoE, the
    breakdown answered by ``breakdown``."""
    d, case, _ = harness
    spec, program = d.load_case(case)
    weights = random_weights(spec, seed=1)
    inputs = random_decode_inputs(spec, 2, seed=9, max_len=40)
    ex, _ = d.make_executor(case, program, weights, 3)
    ex.step(inputs)
    # (Dynamo and AOTAutograd trace the pieces as Inductor gets them.)
    monkeypatch.setattr(d, "MLA_PER_OP_COMPILE", {"backend": "aot_eager"})
    monkeypatch.setattr(d, "graphed", lambda fn: fn)
    monkeypatch.setattr(d, "time_runs", lambda fn, *a, **kw: (fn(), [1.0] * 5)[1])
    monkeypatch.setattr(d, "breakdown", breakdown)

    def mixture(case_dir, spec_, weights_, batch):
        m = load_script("scripts/baseline/per_op.py")
        return m.reference_mixture(spec_, weights_), {"layer_ms": 1.0}

    monkeypatch.setattr(d, "moe_mixture", mixture)
    return lambda: d.mla_timing(case, spec, weights, inputs, ex, program, ex.step,
                                1.0), inputs  # fmt: skip


def test_mla_timing_times_a_per_op_step_of_the_same_function(harness, monkeypatch):
    """mla_timing on CPU: the per-op step computes the kernel's logits on
    the same inputs, its attention alone is timed, the roofline is the
    case's, and the breakdown asks for the MLA rows."""
    d = harness[0]
    asked = []
    timing, inputs = _timing_case(harness, monkeypatch,
                                  lambda *a: asked.append(a[-1]) or {})  # fmt: skip
    out = timing()
    assert "per_op_error" not in out, out
    assert out["per_op_vs_megakernel"] < TOL
    assert out["per_op_graph_ms"] == out["per_op_attention_ms"] == 1.0
    # Every timing kept for measured.py's noise margin.
    assert out["per_op_graph_runs_ms"] == [1.0] * 5
    assert out["roofline"]["context"] == int(inputs.seq_lens[0])
    assert out["per_op_moe"] == "vllm-fused-moe-triton"
    # No FlashInfer here (no GPU): the torch ops' attention, said so.
    assert out["per_op_attention"] == "torch-absorbed-mla"
    assert "flashinfer_mla" not in out
    assert asked == [d.device_mla.ROWS]
    assert set(d.device_mla.ROWS) <= set(d.BREAKDOWN)


def test_flashinfer_mla_runs_after_every_other_figure(harness, monkeypatch):
    """A fault in FlashInfer's MLA decode ends the CUDA context (an illegal
    memory access on its first H200 run took the per-op step and the
    breakdown with it): the torch per-op step and the breakdown come first,
    and a library that failed its check leaves them as they were."""
    d = harness[0]
    order = []
    timing, _ = _timing_case(harness, monkeypatch,
                             lambda *a: order.append("breakdown") or {})  # fmt: skip
    monkeypatch.setattr(d, "DEVICE", "cuda")
    monkeypatch.setattr(d.FlashInferMla, "load", staticmethod(lambda _: object()))

    def faulting_check(*args):
        order.append("flashinfer")
        return {"ok": None, "error": "AcceleratorError('illegal memory access')"}

    monkeypatch.setattr(d, "flashinfer_mla_check", faulting_check)
    out = timing()
    assert order == ["breakdown", "flashinfer"]
    assert out.get("per_op_error") is None, out["per_op_error"]
    assert out["per_op_attention"] == "torch-absorbed-mla"
    assert out["per_op_graph_ms"] == 1.0 and "per_op_error" not in out
    assert out["flashinfer_mla"]["ok"] is None


# ------------------------------------------------------------ FlashInfer MLA


@pytest.fixture(scope="module")
def mla_library(baseline_builds) -> Path:
    """FlashInfer's MLA decode built as device_check.sh builds it (~30 s;
    FlashInfer's own headers warn about unused variables: not asserted)."""
    proc, out = baseline_builds.result("build_flashinfer_mla.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / load_script("scripts/baseline/flashinfer_mla.py").LIBRARY


def test_the_mla_library_needs_nothing_on_the_gpu_machine(mla_library):
    dynamic = subprocess.run(["readelf", "-d", str(mla_library)], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    needed = {line.split("[")[1].rstrip("]") for line in dynamic.splitlines()
              if "(NEEDED)" in line}  # fmt: skip
    assert needed <= {"libc.so.6", "libstdc++.so.6", "libgcc_s.so.1",
                      "libm.so.6", "ld-linux-x86-64.so.2"}  # fmt: skip


def test_the_mla_entry_points_bind_and_check_their_inputs(mla_library):
    """Both entry points are exported; shapes the kernel does not take are
    refused before any GPU work; without a GPU the planner's CUDA error
    comes back as a code, not a crash."""
    fm = load_script("scripts/baseline/flashinfer_mla.py")
    lib = fm.FlashInferMla(mla_library)
    plan = {"batch": 1, "heads": 4, "page_size": 16}
    q_lat = torch.zeros(1, 4, 512, dtype=torch.bfloat16)
    q_pe = torch.zeros(1, 4, 64, dtype=torch.bfloat16)
    out = torch.empty(1, 4, 512, dtype=torch.bfloat16)
    narrow = torch.zeros(2, 16, 512, dtype=torch.bfloat16)  # no k_pe
    with pytest.raises(ValueError, match="cache"):
        lib(q_lat, q_pe, narrow, plan, out, 1.0)
    cache = torch.zeros(2, 16, 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q_pe"):
        lib(q_lat, q_pe[..., :32], cache, plan, out, 1.0)
    with pytest.raises(ValueError, match="another batch"):
        lib(q_lat, q_pe, cache, {**plan, "heads": 8}, out, 1.0)
    if not torch.cuda.is_available():
        info = (ctypes.c_int64 * fm.PLAN_FIELDS)()
        indptr = (ctypes.c_int32 * 2)(0, 1)
        lens = (ctypes.c_int32 * 1)(40)
        err = lib.lib.flashinfer_mla_plan(None, 0, None, None, 0, info, indptr, indptr,
                                          lens, 1, 4, None)  # fmt: skip
        assert err != 0
    assert (
        fm.FlashInferMla.load(mla_library.parent) is None or torch.cuda.is_available()
    )


def test_the_mla_plan_reaches_the_device_and_fits_its_workspaces(mla_library):
    """FlashInfer 0.7's MLAPlan only stages its arrays in the pinned buffer
    and reports their bytes (its Python caller copies them: jit/attention/
    modules.py): the glue copies them itself, else the kernel walks an
    uninitialized work list (the H200's illegal address, 2026-12-04). The
    workspaces hold MLAPlan's arrays for an H200 (scheduler.cuh's sizes)."""
    include = load_script("scripts/baseline/build_flashinfer.py").fetch()[0]
    scheduler = (include / "flashinfer/attention/scheduler.cuh").read_text()
    body = scheduler[scheduler.index("inline cudaError_t MLAPlan(") :]
    body = body[: body.index("\n}\n")]
    assert "staged_int_workspace_bytes = int_allocator" in body
    assert "cudaMemcpyAsync" not in body
    glue = (ROOT / "scripts/baseline/flashinfer_mla.cu").read_text()
    assert "cudaMemcpyAsync(int_ws, int_ws_host, staged," in glue
    fm = load_script("scripts/baseline/flashinfer_mla.py")
    assert "int max_total_num_works = 16384;" in body
    sms, works, tile_q = 132, 16384, 64  # num_clusters * cluster_tile_q = sms * 64
    # Ten arrays per work and five per SM, int32, each aligned to 16 bytes.
    int_bytes = 10 * works * 4 + 5 * (sms * 4 + 16)
    # Two partial o rows (bf16) and lse per cluster row.
    float_bytes = 2 * sms * tile_q * (2 * fm.RANK + 4) + 32
    assert int_bytes <= fm.INT_WORKSPACE and float_bytes <= fm.FLOAT_WORKSPACE
